"""Fault-and-load soak: clients against a live server while its KV files and S3 tier break.

    python -m bench.soak --index DIR --clients 4 --minutes 10            # a built index
    python -m bench.soak --tiny --clients 1 --minutes 0.5                  # tiny random model (CI)

Starts a moto S3 server on loopback and `ragkv serve` in a subprocess (CPU tier and KV tree
off, so every request reads the disk or S3 tier, or computes what they cannot give; S3 tier
on moto; layered loading unless --whole; `--serve-arg=--kv-tree-bytes=...` turns the tree on).
A chunk computed is served as its stored copy reads, so computing and reading give one answer.
A clean pass asks every (question, mode) twice, one at a time, before any fault: the second
greedy answers are the reference (with the tree on, it is served as every later ask is: from
the tree). The loading controller may serve a request of a mode that reads chunk KV by full
prefill when its measured rates say that is sooner (the machine's load decides): the answer's
stats name the mode it ran in, and each answer is checked against the reference of that mode.
A (question, mode) the clean pass never got served as asked (a slow CI host's controller may
prefer full prefill every time) takes its reference from its first such answer under load;
every later one is checked against it, and the report counts them.
Then N client threads ask in rotation (modes
full, reuse, blend, focus) for the duration, while a fault injector, every --fault-every
seconds, in turn flips a byte in a KV file, truncates one, deletes one, stops the S3
server, or starts it again. The server's RSS and open file descriptors are sampled
every second from the end of the clean pass; growth compares the median RSS of the first
minute after --warmup seconds of load with that of the last minute (a single sample swings
by what the requests in flight hold; every sample is in the report).

Prints one JSON report: requests by status code, answers that differ from the clean
pass, faults injected, RSS first/max/last (MiB) and descriptors first/max/last. Exits 1
on any INTERNAL, UNKNOWN, DATA_LOSS or UNAVAILABLE (the server never drains here, so
UNAVAILABLE would be a store failure), any differing answer, RSS growth over
--max-rss-growth (default 10%), or no request answered at all.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import random
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

MODES = ("full", "reuse", "blend", "focus")
FAULTS = ("flip", "truncate", "delete", "s3_stop", "flip", "truncate", "s3_start", "delete")
FAILING_CODES = frozenset({"INTERNAL", "UNKNOWN", "DATA_LOSS", "UNAVAILABLE"})
BUCKET = "ragkv-soak"
_AWS_ENV = {"AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing", "AWS_SESSION_TOKEN": "testing",
            "AWS_DEFAULT_REGION": "us-east-1"}

# A small synthetic corpus (facts about items named alike): --tiny and --make-corpus write it.
_TEAMS = ("alpha", "beta", "gamma", "delta", "omega")
_CITIES = ("Lisbon", "Oslo", "Quito", "Hanoi", "Lagos", "Perth", "Tunis", "Riga")


def write_corpus(folder: Path, n_docs: int, seed: int = 0) -> list[str]:
    """`n_docs` small documents of facts; returns one question per document."""
    rng = random.Random(seed)
    folder.mkdir(parents=True, exist_ok=True)
    questions = []
    for i in range(n_docs):
        item = f"QX-{1000 + i * 37}"
        team, city, code = rng.choice(_TEAMS), rng.choice(_CITIES), rng.randrange(1000, 9999)
        text = (f"Item {item} is maintained by team {team} in {city}. Its access code is {code}. "
                f"The item was commissioned in {2000 + i % 24} and is inspected every {3 + i % 9} months. "
                f"Questions about {item} go to the {team} desk, which answers within {1 + i % 5} days. "
                f"Spare parts for {item} are stored in warehouse {rng.randrange(1, 40)} near {city}.")
        (folder / f"item-{i:03d}.txt").write_text(text)
        questions.append(f"What is the access code of item {item}?")
    return questions


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@dataclass
class Report:
    """What the soak saw."""

    codes: Counter = field(default_factory=Counter)  # status code name -> requests
    by_mode: dict = field(default_factory=dict)  # mode -> Counter of codes
    differing: list = field(default_factory=list)  # (question, mode, got, expected), first 20
    n_differing: int = 0
    # clean-pass answers whose second ask (a KV-tree hit: its last token computed alone) differed
    # from the first (computed with the pass's other rows): a CPU matmul's row differs by ~1e-6
    # between 1 row and 100, and a tiny random model's near-tie flips; counted, not a failure
    first_pass_differs: int = 0
    # (question, mode)s the clean pass never got served as asked: their first answer under load
    references_under_load: int = 0
    faults: Counter = field(default_factory=Counter)  # fault kind -> times injected
    rss_mib: list = field(default_factory=list)  # samples, MiB
    fds: list = field(default_factory=list)  # samples
    lock: threading.Lock = field(default_factory=threading.Lock)

    def check(self, reference: dict[tuple[str, str], str], question: str, mode: str, served: str,
              text: str) -> None:
        """Check an answer to `question` asked in `mode` and run in `served` against `reference`
        ((question, mode run) -> text), which takes it when it holds none for that pair yet."""
        with self.lock:
            expected = reference.get((question, served))
            if expected is None:
                reference[(question, served)] = text
                self.references_under_load += 1
            elif text != expected:
                self.n_differing += 1
                if len(self.differing) < 20:
                    self.differing.append((question, f"{mode} (ran {served})", text, expected))

    def add(self, mode: str, code: str) -> None:
        with self.lock:
            self.codes[code] += 1
            self.by_mode.setdefault(mode, Counter())[code] += 1


class MotoS3:
    """moto's S3 server on loopback, stoppable and restartable on the same port."""

    def __init__(self) -> None:
        from moto.server import ThreadedMotoServer

        self._cls = ThreadedMotoServer
        self.port = _free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self._server = None
        self.start()

    @property
    def up(self) -> bool:
        return self._server is not None

    def start(self) -> None:
        if self._server is None:
            self._server = self._cls(ip_address="127.0.0.1", port=self.port, verbose=False)
            self._server.start()

    def stop(self) -> None:
        if self._server is not None:
            self._server.stop()
            self._server = None


class Server:
    """`ragkv serve` in a subprocess."""

    def __init__(self, index: Path, s3: MotoS3, layered: bool, log_path: Path, extra: list[str]) -> None:
        self.port = _free_port()
        self.addr = f"127.0.0.1:{self.port}"
        env = {**os.environ, **_AWS_ENV, "AWS_ENDPOINT_URL_S3": s3.url}
        env.pop("AWS_PROFILE", None)
        cmd = [sys.executable, "-m", "ragkv.cli", "serve", "--index", f"soak={index}", "--host", "127.0.0.1",
               "--port", str(self.port), "--kv-cpu-bytes", "1", "--kv-s3-uri", f"s3://{BUCKET}/kv",
               "--kv-layered", "on" if layered else "off", "--max-queue", "64", "--kv-tree-bytes", "0",
               "--metrics-port", "0", *extra]  # any free port: CI runs other servers beside it
        self._log = open(log_path, "wb")  # closed in stop()
        self.proc = subprocess.Popen(cmd, env=env, stdout=self._log, stderr=subprocess.STDOUT)

    def wait_serving(self, timeout: float) -> None:
        import grpc
        from grpc_health.v1 import health_pb2, health_pb2_grpc

        deadline = time.monotonic() + timeout
        with grpc.insecure_channel(self.addr) as channel:
            stub = health_pb2_grpc.HealthStub(channel)
            while time.monotonic() < deadline:
                if self.proc.poll() is not None:
                    raise RuntimeError(f"the server exited with {self.proc.returncode} while loading")
                try:
                    if stub.Check(health_pb2.HealthCheckRequest(), timeout=2).status == 1:
                        return
                except grpc.RpcError:
                    pass
                time.sleep(0.5)
        raise TimeoutError(f"the server did not serve within {timeout:.0f} s")

    def sample(self) -> tuple[float, int]:
        """(RSS in MiB, open descriptors) of the server process."""
        rss = 0.0
        with open(f"/proc/{self.proc.pid}/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    rss = int(line.split()[1]) / 1024
        return rss, len(os.listdir(f"/proc/{self.proc.pid}/fd"))

    def stop(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(60)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        self._log.close()


def _kv_files(index: Path) -> list[Path]:
    return [f for f in (index / "kv").rglob("*.safetensors") if ".quarantine" not in f.parts]


def inject(kind: str, index: Path, s3: MotoS3, rng: random.Random) -> bool:
    """One fault; False if there was nothing to do it to."""
    if kind == "s3_stop":
        s3.stop()
        return True
    if kind == "s3_start":
        s3.start()
        return True
    files = _kv_files(index)
    if not files:
        return False
    f = rng.choice(files)
    try:
        if kind == "delete":
            f.unlink()
        else:
            size = f.stat().st_size
            if size < 2:
                return False
            with open(f, "r+b") as fh:
                if kind == "truncate":
                    fh.truncate(rng.randrange(1, size))
                else:  # flip one bit past the header, where the tensors are
                    pos = rng.randrange(size // 8, size)
                    fh.seek(pos)
                    byte = fh.read(1)
                    fh.seek(pos)
                    fh.write(bytes([byte[0] ^ (1 << rng.randrange(8))]))
    except FileNotFoundError:  # the server moved it meanwhile (quarantine, rewrite)
        return False
    return True


def _ask(client, question: str, mode: str, args: argparse.Namespace) -> tuple[str, str | None, str | None]:
    """(status code, answer text, the mode it ran in: `mode`, or full when the loading controller
    served it by full prefill because its measured rates said that was sooner)."""
    import grpc

    try:
        stream = client.query(question, collection="soak", mode=mode, top_k=args.top_k,
                              max_new_tokens=args.max_new_tokens, temperature=0.0)
        stats = stream.result()
        return "OK", stats.text, stats.mode.value
    except grpc.RpcError as e:
        return e.code().name, None, None


def run(args: argparse.Namespace) -> dict:
    from ragkv.client import RagClient
    from ragkv.retry import NO_RETRY

    work = Path(args.workdir or tempfile.mkdtemp(prefix="ragkv-soak-"))
    questions = list(args.question or [])
    if args.tiny:
        index, tiny_questions = build_tiny(work)
        questions = questions or tiny_questions
    else:
        if args.index is None:
            raise SystemExit("give --index DIR (a built index) or --tiny")
        index = Path(args.index)
        if args.copy_index:  # faults damage the index: work on a copy
            import shutil

            copy = work / "index"
            shutil.copytree(index, copy)
            index = copy
    if not questions:
        questions = json.loads((index / "soak-questions.json").read_text())
    questions = questions[: args.max_questions]

    import boto3

    logging.getLogger("werkzeug").setLevel(logging.ERROR)  # moto's access log, a line per S3 call
    os.environ.update(_AWS_ENV)
    s3 = MotoS3()
    boto3.client("s3", endpoint_url=s3.url).create_bucket(Bucket=BUCKET)
    server = Server(index, s3, not args.whole, work / "server.log", args.serve_arg or [])
    report = Report()
    stop = threading.Event()
    try:
        server.wait_serving(args.load_timeout)
        reference: dict[tuple[str, str], str] = {}
        with RagClient(server.addr, timeout=args.timeout, retry=NO_RETRY) as client:
            for q in questions:  # the clean pass, each (question, mode) twice: the second is the reference
                for mode in MODES:
                    seen: list[str] = []
                    for _ in range(6):  # answers served as asked, not by full prefill instead
                        code, text, served = _ask(client, q, mode, args)
                        if code != "OK" or text is None:
                            raise RuntimeError(f"the clean pass got {code} for {mode} {q!r}: see {work / 'server.log'}")
                        if served == mode:
                            seen.append(text)
                        if len(seen) == 2:
                            break
                    if len(seen) == 2 and seen[0] != seen[1]:
                        report.first_pass_differs += 1
                    if seen:  # else its first answer served as asked under load is its reference
                        reference[(q, mode)] = seen[-1]

        def sampler() -> None:
            while not stop.is_set():
                try:
                    rss, fds = server.sample()
                except OSError:
                    return
                report.rss_mib.append(round(rss, 1))
                report.fds.append(fds)
                stop.wait(1.0)

        def client_loop(i: int) -> None:
            rng = random.Random(1000 + i)
            with RagClient(server.addr, timeout=args.timeout, retry=NO_RETRY) as client:
                n = i
                while not stop.is_set():
                    q, mode = rng.choice(questions), MODES[n % len(MODES)]
                    n += 1
                    code, text, served = _ask(client, q, mode, args)
                    report.add(mode, code)
                    if code != "OK" or served is None:
                        continue
                    report.check(reference, q, mode, served, text)

        def injector() -> None:
            rng = random.Random(args.seed)
            k = 0
            while not stop.wait(args.fault_every):
                kind = FAULTS[k % len(FAULTS)]
                k += 1
                if inject(kind, index, s3, rng):
                    with report.lock:
                        report.faults[kind] += 1

        threads = [threading.Thread(target=sampler, daemon=True)]
        threads += [threading.Thread(target=client_loop, args=(i,), daemon=True) for i in range(args.clients)]
        if not args.no_faults:
            threads.append(threading.Thread(target=injector, daemon=True))
        for t in threads:
            t.start()
        stop.wait(args.minutes * 60)
        stop.set()
        for t in threads:
            t.join(args.timeout + 10)
        s3.start()
    finally:
        stop.set()
        server.stop()
        s3.stop()
    everything = report.rss_mib or [0.0]
    skip = min(len(everything) - 1, int(args.warmup))  # samples are 1 s apart
    rss, fds = everything[skip:], (report.fds or [0])[skip:] or [0]
    growth, start_mib, end_mib, window = rss_growth(rss)
    return {
        "clients": args.clients, "minutes": args.minutes, "layered": not args.whole, "index": str(index),
        "questions": len(questions), "requests": sum(report.codes.values()),
        "codes": dict(report.codes), "codes_by_mode": {m: dict(c) for m, c in report.by_mode.items()},
        "differing_answers": report.n_differing, "differing_examples": report.differing,
        "first_pass_differs": report.first_pass_differs, "references_under_load": report.references_under_load,
        "faults": dict(report.faults),
        "rss_mib": {"first": rss[0], "max": max(rss), "last": rss[-1], "median_first_window": start_mib,
                    "median_last_window": end_mib, "window_s": window},
        # the whole run, including the warm-up: one sample per tenth of it
        "rss_mib_by_tenth": [everything[min(len(everything) - 1, i * len(everything) // 10)] for i in range(11)],
        "warmup_seconds": args.warmup,
        "rss_growth": growth,
        "rss_mib_samples": everything,  # one a second, from the end of the clean pass
        "open_fds": {"first": fds[0], "max": max(fds), "last": fds[-1]},
        "server_log": str(work / "server.log"),
    }


def rss_growth(samples: list[float]) -> tuple[float, float, float, int]:
    """(growth, first median, last median, window) of RSS samples taken 1 s apart.

    A sample holds whatever the requests in flight hold at that second (hundreds of MiB
    either way), so growth compares the medians of the first and last minute (a fifth of
    the samples when there are fewer than five minutes of them).
    """
    window = max(1, min(60, len(samples) // 5))
    first, last = statistics.median(samples[:window]), statistics.median(samples[-window:])
    return ((last - first) / first if first else 0.0), first, last, window


def build_tiny(work: Path) -> tuple[Path, list[str]]:
    """A tiny random Llama, a 12-document corpus and its index under `work`."""
    from ragkv.evals.testing import tiny_model_dir
    from ragkv.indexer.chunking import ChunkingConfig
    from ragkv.indexer.job import IndexJobConfig, run_index
    from ragkv.indexer.neighbours import INDEX_DEFAULT, INDEX_KV_COMPRESSION, PLAIN_COPY_COMPRESSION

    model = tiny_model_dir(work / "tiny-llama", "llama")
    questions = write_corpus(work / "corpus", 12)
    # as `ragkv index` builds it: neighbour KV in int4, plain copies in int8 (the files the faults break)
    run_index(IndexJobConfig(corpus=work / "corpus", out=work / "index", model=str(model),
                             chunking=ChunkingConfig(size=32, overlap=0), progress=False, neighbours=INDEX_DEFAULT,
                             kv_compression=INDEX_KV_COMPRESSION, plain_kv_compression=PLAIN_COPY_COMPRESSION))
    return work / "index", questions


def failures(result: dict, max_rss_growth: float) -> list[str]:
    """Why the soak failed; empty when it passed."""
    why = [f"{n} request(s) ended {code}" for code, n in result["codes"].items() if code in FAILING_CODES]
    if result["differing_answers"]:
        why.append(f"{result['differing_answers']} answer(s) differ from the clean pass")
    if result["rss_growth"] > max_rss_growth:
        why.append(f"server RSS grew {result['rss_growth']:.1%} ({result['rss_mib']}), over {max_rss_growth:.0%}")
    if not result["codes"].get("OK"):
        why.append("no request was answered")
    return why


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m bench.soak", description=__doc__.split("\n\n")[0])
    p.add_argument("--index", type=Path, help="a built index (faults damage its KV files: see --copy-index)")
    p.add_argument("--copy-index", action="store_true", help="soak a copy of --index, in --workdir")
    p.add_argument("--tiny", action="store_true", help="build a tiny random model and index first (CI)")
    p.add_argument("--make-corpus", type=Path, help="write the synthetic corpus (40 docs) here and exit")
    p.add_argument("--question", action="append", help="a question to ask (repeatable); default: "
                   "INDEX/soak-questions.json, or the tiny corpus's")
    p.add_argument("--max-questions", type=int, default=8, help="questions in rotation")
    p.add_argument("--clients", type=int, default=4)
    p.add_argument("--minutes", type=float, default=10.0)
    p.add_argument("--fault-every", type=float, default=3.0, help="seconds between faults")
    p.add_argument("--no-faults", action="store_true", help="load only")
    p.add_argument("--whole", action="store_true", help="serve with --kv-layered off")
    p.add_argument("--top-k", type=int, default=4)
    p.add_argument("--max-new-tokens", type=int, default=16)
    p.add_argument("--timeout", type=float, default=180.0, help="seconds per request")
    p.add_argument("--load-timeout", type=float, default=600.0, help="seconds for the server to load")
    p.add_argument("--warmup", type=float, default=0.0, help="seconds of load before the first RSS sample "
                   "that growth is measured from (allocator arenas and batch buffers fill under concurrency)")
    p.add_argument("--max-rss-growth", type=float, default=0.10, help="fail above this RSS growth (fraction)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--workdir", type=Path, help="where the tiny index, copies and the server log go")
    p.add_argument("--serve-arg", action="append", help="extra `ragkv serve` argument (repeatable, use =)")
    p.add_argument("--json", type=Path, help="also write the report here")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.make_corpus is not None:
        questions = write_corpus(args.make_corpus, 40)
        (args.make_corpus / "soak-questions.json").write_text(json.dumps(questions))
        print(f"wrote 40 documents to {args.make_corpus}; copy soak-questions.json into the index folder")
        return 0
    result = run(args)
    why = failures(result, args.max_rss_growth)
    result["passed"], result["failures"] = not why, why
    text = json.dumps(result, indent=2, default=str)
    print(text)
    if args.json is not None:
        args.json.write_text(text)
    return 1 if why else 0


if __name__ == "__main__":
    raise SystemExit(main())
