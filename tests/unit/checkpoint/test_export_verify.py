"""``elastic-ddp export`` verifies what it reads, on local disk and on the S3 server: a
whole checkpoint exports to a file that ``torch.load(weights_only=True)`` reads back equal
to the checkpoint's model; a damaged or incomplete one (a shard cut short, a changed
byte, a shard or the manifest missing, a changed index) is refused with one line naming
the checkpoint, the file and what is wrong, exit 2, and no file left where the output
was asked for."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from elastic_ddp.checkpoint import MANIFEST, checkpoint_name
from elastic_ddp.checkpoint.manager import CheckpointManager
from elastic_ddp.driver import cli

RUN = "exp"


def _cfg():
    from elastic_ddp.config import Config

    return Config.from_dict({
        "data": {"train_path": "unused"}, "task": {"kwargs": {"block_size": 16}},
        "model": {"name": "gpt", "kwargs": {"n_embd": 32, "n_head": 2, "n_layer": 2}},
        "optim": {"name": "adamw", "lr": 3e-3}, "parallel": {"strategy": "ddp"},
        "batch": {"global_batch_size": 4, "micro_batch_size": 4}})


@pytest.fixture(scope="module")
def written(tmp_path_factory) -> tuple[Path, dict]:
    """A checkpoint of one process (model and AdamW state after one step) and its model."""
    from elastic_ddp.parallel.strategies import build_strategy
    from elastic_ddp.tasks.loading import build_model, load_task

    base = tmp_path_factory.mktemp("export")
    cfg = _cfg()
    task = load_task(cfg)
    torch.manual_seed(3)
    s = build_strategy(cfg, build_model(cfg, task), torch.device("cpu"), 1)
    x = torch.randint(0, 256, (4, 17), generator=torch.Generator().manual_seed(3))
    task.loss(s.model, {"tokens": x})[0].sum().backward()
    s.optimizer.step()
    CheckpointManager(str(base), RUN, None, 0, 1, collective=False,
                      log=lambda m: None).save(1, s, {"progress": {"step": 1}}, report=False)
    want = {k: v.detach().clone() for k, v in s.module.state_dict().items()}
    return base / RUN / checkpoint_name(1), want


def _shard(d: Path) -> str:
    return sorted(f for f in json.loads((d / MANIFEST).read_text())["files"] if f.endswith(".distcp"))[0]


def _damage(d: Path, how: str) -> str:
    """Damage the checkpoint at ``d``; the file the refusal must name."""
    shard = d / _shard(d)
    if how == "cut":
        with open(shard, "r+b") as f:
            f.truncate(shard.stat().st_size // 3)
        return shard.name
    if how == "byte":  # the size is right: only the checksum can tell
        data = bytearray(shard.read_bytes())
        data[len(data) // 2] ^= 0xFF
        shard.write_bytes(bytes(data))
        return shard.name
    if how == "shard_missing":
        shard.unlink()
        return shard.name
    if how == "index":
        data = bytearray((d / ".metadata").read_bytes())
        data[-10] ^= 0x01
        (d / ".metadata").write_bytes(bytes(data))
        return ".metadata"
    assert how == "no_manifest"
    (d / MANIFEST).unlink()
    return MANIFEST


WHAT = {"cut": "bytes, the manifest says", "byte": "xxh3_64", "shard_missing": "(missing)",
        "index": "xxh3_64", "no_manifest": "incomplete: its write did not finish"}


def _cli(capsys, *args) -> tuple[int, str, str]:
    rc = cli.main(["export", *map(str, args)])
    out, err = capsys.readouterr()
    return rc, out, err


def _equal(a: dict, b: dict) -> bool:
    return set(a) == set(b) and all(torch.equal(a[k], b[k]) for k in a)


@pytest.mark.parametrize("how", list(WHAT))
def test_a_damaged_checkpoint_is_refused_naming_the_file_and_nothing_is_written(
        written, tmp_path, capsys, how):
    d = tmp_path / checkpoint_name(1)
    shutil.copytree(written[0], d)
    bad = _damage(d, how)
    out = tmp_path / "out" / "model.pt"
    rc, _, err = _cli(capsys, d, out)
    assert rc == 2, err
    lines = err.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in err, err
    assert str(d) in lines[0] and bad in lines[0] and WHAT[how] in lines[0], lines[0]
    assert not out.exists() and not (out.parent.exists() and any(out.parent.iterdir()))
    if how == "cut":  # --no-verify: no check, and still one line, no EOFError traceback
        rc, _, err = _cli(capsys, d, out, "--no-verify")
        assert rc == 2 and len(err.strip().splitlines()) == 1 and "cannot be loaded" in err, err
        assert not out.exists()
    if how == "byte":  # --no-verify reads the changed bytes as they are
        rc, _, err = _cli(capsys, d, out, "--no-verify")
        assert rc in (0, 2) and "Traceback" not in err, err


def test_export_on_local_disk_as_a_user_runs_it(written, tmp_path):
    d, want = written
    out = tmp_path / "model.pt"
    p = subprocess.run([sys.executable, "-m", "elastic_ddp", "export", str(d), str(out)],
                       capture_output=True, text=True, timeout=300, check=False)
    assert p.returncode == 0, p.stderr
    assert _equal(torch.load(out, weights_only=True), want)
    assert [f.name for f in tmp_path.iterdir()] == ["model.pt"], "no temporary file left"


def _upload(local: Path, s3, key: str) -> str:
    import pyarrow.fs as pafs

    from elastic_ddp.paths import uri_to_filesystem

    fs, path = uri_to_filesystem(s3.uri(key))
    pafs.copy_files(str(local), path, destination_filesystem=fs)
    return s3.uri(key)


@pytest.mark.slow
def test_export_from_s3_as_a_user_runs_it_and_a_cut_shard_there_is_refused(written, s3, tmp_path):
    d, want = written
    uri = _upload(d, s3, f"runs/{RUN}/{checkpoint_name(1)}")
    env = {**os.environ, **s3.env}
    out = tmp_path / "model.pt"
    p = subprocess.run([sys.executable, "-m", "elastic_ddp", "export", uri, str(out)], env=env,
                       capture_output=True, text=True, timeout=300, check=False)
    assert p.returncode == 0, p.stderr
    assert _equal(torch.load(out, weights_only=True), want)

    # A shard cut short on the store (an upload that stopped), then the manifest gone.
    shard = _shard(d)
    key = f"runs/{RUN}/{checkpoint_name(1)}/{shard}"
    body = s3.client.get_object(Bucket=s3.name, Key=key)["Body"].read()
    s3.client.put_object(Bucket=s3.name, Key=key, Body=body[: len(body) // 2])
    out2 = tmp_path / "model2.pt"
    p = subprocess.run([sys.executable, "-m", "elastic_ddp", "export", uri, str(out2)], env=env,
                       capture_output=True, text=True, timeout=300, check=False)
    assert p.returncode == 2, p.stderr
    line = p.stderr.strip()
    assert "\n" not in line and uri in line and shard in line and "the manifest says" in line, line
    assert not out2.exists()
    s3.client.delete_object(Bucket=s3.name, Key=f"runs/{RUN}/{checkpoint_name(1)}/{MANIFEST}")
    p = subprocess.run([sys.executable, "-m", "elastic_ddp", "export", uri, str(out2)], env=env,
                       capture_output=True, text=True, timeout=300, check=False)
    assert p.returncode == 2 and "incomplete: its write did not finish" in p.stderr, p.stderr
    assert not out2.exists()


def test_an_s3_export_reads_the_model_not_the_optimizer(written, s3):
    """Unverified, an export reads the index and the model's items only; verified, it
    adds one streamed read of each file it uses (hashed, not stored)."""
    from elastic_ddp.checkpoint.store_reader import StoreReader, load_keys

    d, want = written
    uri = _upload(d, s3, "c")
    reader = StoreReader(uri)
    got = load_keys(uri, "model.", reader=reader)
    assert _equal(got, want)
    shard_bytes = sum(f.stat().st_size for f in d.glob("*.distcp"))
    model_bytes = sum(v.numel() * v.element_size() for v in want.values())
    assert reader.bytes_read - (d / ".metadata").stat().st_size < 0.5 * shard_bytes
    assert reader.bytes_read >= model_bytes
