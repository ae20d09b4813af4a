"""The client side never imports torch: `import ragkv`, the SDK, and `ragkv query`."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
HEAVY = ("torch", "transformers", "faiss", "sentence_transformers")

_PROBE = """
import sys
{body}
heavy = sorted(m for m in sys.modules if m.split('.')[0] in {heavy!r})
print('HEAVY:' + ','.join(heavy))
"""


@pytest.mark.parametrize(
    "body",
    [
        "import ragkv; ragkv.RagClient, ragkv.AsyncRagClient",
        "import ragkv.client, ragkv.convert, ragkv.types; from ragkv.client import RagClient, AsyncRagClient",
        "from ragkv.cli.main import build_parser; build_parser().parse_args(['query', 'q'])",
        # `ragkv query` end to end, against a port nobody listens on.
        "from ragkv.cli.main import main; rc = main(['query', 'q', '--addr', '127.0.0.1:1', '--timeout', '1'])",
    ],
)
def test_client_paths_do_not_import_torch(body: str) -> None:
    out = subprocess.run(
        [sys.executable, "-c", _PROBE.format(body=body, heavy=HEAVY)],
        cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)}, capture_output=True, text=True, timeout=60,
    )
    assert "HEAVY:" in out.stdout, out.stderr
    assert out.stdout.strip().splitlines()[-1] == "HEAVY:", out.stdout
