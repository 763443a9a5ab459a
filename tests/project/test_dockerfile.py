"""``cluster/Dockerfile`` and the root ``.dockerignore``, without docker: torch is pinned
to a CUDA build by version, the image gets everything it runs, and the build context
keeps the venv, data, stores and .git out. Fast: no docker, no network.

The ``.dockerignore`` matcher below follows Docker's rules (moby/patternmatcher): one
pattern a line, ``#`` comments, paths relative to the context root (a leading ``/`` is
dropped), ``*`` and ``?`` within one path segment, ``**`` across any number of them, a
pattern excludes a path when it matches the path or one of its parent directories, a
``!`` pattern re-includes, and the last matching pattern wins.
"""

from __future__ import annotations

import os
import posixpath
import re
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
DOCKERFILE = ROOT / "cluster" / "Dockerfile"


def _pattern_regex(pattern: str) -> re.Pattern:
    out, i = "^", 0
    while i < len(pattern):
        c = pattern[i]
        if pattern.startswith("**", i):
            i += 2
            if pattern.startswith("/", i):  # "**/": zero or more whole segments
                out += "(?:.*/)?"
                i += 1
            else:
                out += ".*"
            continue
        if c == "*":
            out += "[^/]*"
        elif c == "?":
            out += "[^/]"
        elif c == "\\" and i + 1 < len(pattern):
            i += 1
            out += re.escape(pattern[i])
        elif c == "[":
            j = pattern.find("]", i + 1)
            if j < 0:
                out += re.escape(c)
            else:
                out += "[" + pattern[i + 1:j].replace("!", "^", 1) + "]"
                i = j
        else:
            out += re.escape(c)
        i += 1
    return re.compile(out + "$")


def parse_dockerignore(text: str) -> list[tuple[bool, re.Pattern, str]]:
    """(is_exception, regex, pattern) per rule, in file order."""
    rules = []
    for line in text.splitlines():
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        neg = line.startswith("!")
        pat = posixpath.normpath(line[1:].strip() if neg else line).lstrip("/")
        rules.append((neg, _pattern_regex(pat), pat))
    return rules


def excluded(rules, path: str) -> bool:
    """Whether Docker leaves ``path`` (relative, '/'-separated) out of the context."""
    parts = path.strip("/").split("/")
    prefixes = ["/".join(parts[:n]) for n in range(1, len(parts) + 1)]
    result = False
    for neg, rx, _ in rules:
        if any(rx.match(p) for p in prefixes):
            result = not neg
    return result


def context_files(root: Path, rules) -> list[str]:
    """Files a ``docker build`` of ``root`` would send, walking the real tree (a directory
    excluded by a rule is not entered when no ``!`` rule could bring a file back)."""
    can_reinclude = any(neg for neg, _, _ in rules)
    out = []
    for d, dirs, files in os.walk(root):
        rel = Path(d).relative_to(root).as_posix()
        rel = "" if rel == "." else rel + "/"
        if not can_reinclude:
            dirs[:] = [x for x in dirs if not excluded(rules, rel + x)]
        out += [rel + f for f in files if not excluded(rules, rel + f)]
    return out


RULES = parse_dockerignore((ROOT / ".dockerignore").read_text())


# --------------------------------------------------------------------------- the matcher
def test_matcher_follows_dockers_documented_examples():
    rules = parse_dockerignore("# comment\n*/temp*\n*/*/temp*\ntemp?\n**/*.go\n*.md\n!README*.md\n/abs\n")
    assert excluded(rules, "somedir/temporary.txt") and excluded(rules, "somedir/temp")
    assert excluded(rules, "somedir/subdir/temporary.txt")
    assert not excluded(rules, "temporary.txt") and excluded(rules, "tempa")
    assert not excluded(rules, "a/b/c/temp.txt")
    assert excluded(rules, "x.go") and excluded(rules, "a/b/c.go")
    assert excluded(rules, "CHANGES.md") and not excluded(rules, "README-secret.md")
    assert excluded(rules, "abs/file") and not excluded(rules, "x/abs")
    # a directory pattern covers everything below it; patterns are anchored at the root
    rules = parse_dockerignore("data\n")
    assert excluded(rules, "data/a/b.parquet") and not excluded(rules, "pkg/data/scan.py")


# --------------------------------------------------------------------------- .dockerignore
@pytest.mark.parametrize("path", [
    ".venv/bin/python", ".venv/lib/python3.11/site-packages/torch/lib/libtorch_cpu.so",
    "venv/bin/python", "experiments/.venv/bin/python",
    "data/digits/train/part-0.parquet", "data/pycode/val/part-1.parquet",
    "mlruns/0/meta.yaml", "mlartifacts/1/a.png", "mlflow.db", "mlflow-server.db",
    "ray_results/digits-cnn/checkpoint_000001/state.pt", "checkpoints/a/state.pt",
    "outputs/plot.png", ".git", ".git/HEAD", ".env", "cluster/.env",
    "elastic_ddp/__pycache__/cli.cpython-311.pyc", ".pytest_cache/v/cache/nodeids",
    "elastic_ddp.egg-info/PKG-INFO", "build/lib/x.py", "tests/unit/config/test_config.py",
])
def test_dockerignore_keeps_heavy_and_private_files_out(path):
    assert excluded(RULES, path), f"{path} would be sent to the docker daemon"


def _copy_sources() -> list[str]:
    srcs = []
    for line in DOCKERFILE.read_text().replace("\\\n", " ").splitlines():
        if line.startswith("COPY "):
            args = [a for a in line.split()[1:] if not a.startswith("--")]
            srcs += args[:-1]
    return srcs


def test_everything_the_image_copies_is_in_the_context():
    """Every COPY source exists, and none of its tracked files is ignored (a pattern like
    ``data`` must not drop ``elastic_ddp/data/``)."""
    srcs = _copy_sources()
    assert {"pyproject.toml", "README.md", "elastic_ddp", "experiments", "cluster"} <= set(srcs)
    git = subprocess.run(["git", "ls-files"], cwd=ROOT, capture_output=True, text=True)
    if git.returncode == 0:
        tracked = git.stdout.split()
    else:  # an export without .git: every file but caches
        tracked = [p.relative_to(ROOT).as_posix() for p in ROOT.rglob("*")
                   if p.is_file() and "__pycache__" not in p.parts]
    for src in srcs:
        assert (ROOT / src).exists(), f"COPY {src}: not in the repo"
        under = [f for f in tracked if f == src or f.startswith(src.rstrip("/") + "/")]
        assert under, f"COPY {src}: no tracked file"
        dropped = [f for f in under if excluded(RULES, f)]
        assert not dropped, f"COPY {src}: .dockerignore drops {dropped[:5]}"
    assert not excluded(RULES, "elastic_ddp/data/scan.py")
    assert not excluded(RULES, "cluster/runtime_env.yaml")


def test_build_context_of_this_checkout_is_small():
    """The real working tree (with its multi-GB .venv, and whatever data and stores lie
    here) makes a context of a few hundred kB."""
    files = context_files(ROOT, RULES)
    size = sum((ROOT / f).stat().st_size for f in files)
    assert "elastic_ddp/driver/cli.py" in files and "cluster/Dockerfile" in files
    assert not [f for f in files if f.split("/")[0] in (".venv", "data", "mlruns", "ray_results", ".git")]
    assert size < 5 * 2**20, f"build context is {size} bytes"


# --------------------------------------------------------------------------- Dockerfile
def _args() -> dict[str, str]:
    return dict(re.findall(r"^ARG (\w+)=(\S+)$", DOCKERFILE.read_text(), re.M))


def test_torch_is_a_pinned_cuda_build_from_the_pytorch_index():
    text = DOCKERFILE.read_text()
    args = _args()
    assert re.fullmatch(r"\d+\.\d+\.\d+", args["TORCH_VERSION"])
    assert re.fullmatch(r"cu\d{3}", args["TORCH_CUDA"])
    installs = [ln for ln in text.replace("\\\n", " ").splitlines() if "pip install" in ln]
    torch_installs = [ln for ln in installs if any(
        re.fullmatch(r"torch([=<>~!].*)?", tok.strip('"\'')) for tok in ln.split("&&")[0].split())]
    assert len(torch_installs) == 1
    (line,) = torch_installs
    assert '"torch==${TORCH_VERSION}+${TORCH_CUDA}"' in line
    assert '--index-url "https://download.pytorch.org/whl/${TORCH_CUDA}"' in line
    # The package install is held to that torch and checks what it got.
    (pkg,) = [ln for ln in installs if " . " in ln]
    assert "-c /home/ray/torch-constraint.txt" in pkg
    assert "torch.__version__ == '${TORCH_VERSION}+${TORCH_CUDA}'" in pkg and "torch.version.cuda" in pkg


def test_image_torch_is_the_version_the_tests_use():
    """The image's torch is the one `make setup` installs (Makefile TORCH_SPEC)."""
    spec = re.search(r"^TORCH_SPEC \?= torch==(\S+)$", (ROOT / "Makefile").read_text(), re.M).group(1)
    assert _args()["TORCH_VERSION"] == spec
