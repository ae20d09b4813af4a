"""evals: tools that measure the engine, kept out of the runtime package.

`evaluate` (fidelity of a blended prompt against full prefill: KL, answer agreement, F1),
`split` (held-out evaluation: seeded splits and folds, tuning on one part, reporting on
another), `replay` (focus's handover rule replayed from recorded rows), `synthetic` (needle
tasks) and `testing` (tiny random-weight models of every family, for
tests and benchmarks). The CLI's `ragkv eval` and `ragkv bench` use them; `ragkv serve`
and `ragkv index` never import them.
"""
