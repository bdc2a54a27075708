"""Storage faults: a disk that fills during a save (a small tmpfs made by the test), corrupted, truncated or
mismatched checkpoints and a missing ``latest``. Every rank gets the same one-line error before any rank
changed state; the previous checkpoint stays the latest and loads."""
import os
import re
import tempfile

import pytest
import torch
import torch.distributed as dist

from tests.harness import run_ranks

from lab.chaos.chaos_data import NoTmpfs, build_trainer, fill_disk, params_snapshot, tmpfs

BASE = ["--mock-data", "--vocab-size", "64", "--global-batch-size", "8", "--use-distributed-optimizer"]


def _disk_full(rank, world, mnt, mode):
    from megareshard.checkpoint import CheckpointError

    root = os.path.join(mnt, "ckpt")
    argv = BASE + ["--train-iters", "4", "--save", root, "--save-interval", "2", "--on-save-failure", mode]
    tr = build_trainer(argv, world)
    tr.cfg.training.train_iters = 2
    tr.train()                                   # iteration 2 saved
    if rank == 0:
        fill_disk(mnt)                           # leave a few KiB: the next save cannot fit
    dist.barrier()
    tr.cfg.training.train_iters = 4
    try:
        tr.train()
        result = ("finished", tr.iteration, tr.save_failures)
    except CheckpointError as e:
        result = ("stopped", tr.iteration, str(e))
    tr.close()
    dist.barrier()
    if rank == 0:
        for fn in os.listdir(mnt):
            if fn.startswith("filler"):
                os.remove(os.path.join(mnt, fn))
    dist.barrier()
    loaded = build_trainer(BASE + ["--train-iters", "4", "--load", root], world)  # the previous checkpoint loads
    return result, loaded.iteration, open(os.path.join(root, "latest")).read().strip(), sorted(os.listdir(root))


def _disk_full_both(rank, world, mnts):
    return {mode: _disk_full(rank, world, mnt, mode) for mode, mnt in mnts.items()}


def test_disk_full_during_save():
    disks, mnts = [], {}
    try:
        for mode in ("stop", "continue"):
            disks.append(tmpfs(1024))  # KiB: room for one checkpoint of the tiny model
            try:
                mnts[mode] = disks[-1].__enter__()
            except NoTmpfs as e:
                disks.pop()
                pytest.skip(str(e))  # not root, or mounting is not allowed here: the reason says which
        results = run_ranks(_disk_full_both, 2, mnts, timeout=240)
    finally:
        for d in disks:
            d.__exit__(None, None, None)
    for mode in ("stop", "continue"):
        for result, iteration, latest, files in (r[mode] for r in results):
            assert latest == "iter_0000002" and iteration == 2, (latest, iteration)
            assert [f for f in files if f.startswith((".tmp", "latest."))] == [], files  # no debris left
            if mode == "stop":
                kind, at, msg = result
                assert kind == "stopped" and at == 4, result
                assert "saving iteration 4 to" in msg and "No space left on device" in msg, msg
                assert msg.endswith("latest still names iter_0000002") and "\n" not in msg, msg
                # which rank, which file, the space needed and free; short once its paths are aside
                assert re.search(r"rank \d ran out of space writing \S+/\.tmp\.iter_0000004/__\d_0\.distcp: No space "
                                 r"left on device; the checkpoint needs about [\d.]+ KiB, [\d.]+ KiB free in ", msg), msg
                assert len(re.sub(r"/\S+", "P", msg)) < 300, msg
            else:
                assert result[:2] == ("finished", 4) and result[2] >= 1, result
        assert results[0][mode][0] == results[1][mode][0]  # the same error on both ranks


def _bad_checkpoints(rank, world, root):
    from megareshard.checkpoint import CheckpointError

    tr = build_trainer(BASE + ["--train-iters", "1", "--save", root], world)
    tr.train()
    tr.close()
    ck = os.path.join(root, "iter_0000001")
    errors = {}

    def attempt(name, argv, damage=None, undo=None, path=root):
        if rank == 0 and damage:
            damage()
        dist.barrier()
        fresh = build_trainer(BASE + ["--train-iters", "1"] + argv, world)
        before = params_snapshot(fresh)
        try:
            fresh.checkpoints.load(path, model=fresh.model, optimizer=fresh.optimizer, scheduler=fresh.scheduler,
                                   sampler=fresh.sampler, config=fresh.cfg)
            errors[name] = None
        except CheckpointError as e:
            after = params_snapshot(fresh)
            errors[name] = (str(e), all(torch.equal(before[k], after[k]) for k in before))
        dist.barrier()
        if rank == 0 and undo:
            undo()
        dist.barrier()

    shard = os.path.join(ck, "__0_0.distcp")   # files sorted: .metadata, __0_0, __1_0: rank 1 checksums this one
    data = open(shard, "rb").read()

    def flip():
        with open(shard, "r+b") as f:
            f.seek(len(data) // 2)
            f.write(bytes([data[len(data) // 2] ^ 0xFF]))

    def restore():
        with open(shard, "wb") as f:
            f.write(data)

    def truncate():
        with open(shard, "r+b") as f:
            f.truncate(len(data) - 100)

    attempt("corrupt", [], flip, restore)
    attempt("truncated", [], truncate, restore)
    attempt("shape", ["--hidden-size", "64"])
    attempt("vocab", ["--vocab-size", "80"])
    latest = os.path.join(root, "latest")
    attempt("no-latest", [], lambda: os.rename(latest, latest + ".away"), lambda: os.rename(latest + ".away", latest))
    attempt("intact", [])
    return errors


def test_bad_checkpoints_fail_on_every_rank_before_loading():
    with tempfile.TemporaryDirectory() as tmp:
        results = run_ranks(_bad_checkpoints, 2, os.path.join(tmp, "ckpt"), timeout=180)
    assert results[0] == results[1], results          # every rank: the same error
    r = results[0]
    assert r["intact"] is None
    for name in ("corrupt", "truncated", "shape", "vocab", "no-latest"):
        msg, untouched = r[name]
        assert untouched and "\n" not in msg and len(re.sub(r"/\S+", "P", msg)) < 300, (name, msg)
    assert "__0_0.distcp is corrupt: CRC-32" in r["corrupt"][0] and "seen by rank(s) 1" in r["corrupt"][0]
    assert "__0_0.distcp has" in r["truncated"][0] and "truncated" in r["truncated"][0]
    assert "model config hidden_size: checkpoint 32, this run 64" in r["shape"][0]
    assert re.search(r"; \d+ tensor\(s\) of another shape$", r["shape"][0]), r["shape"][0]   # counted, not listed
    assert "model config vocab_size: checkpoint 64, this run 80" in r["vocab"][0]
    assert "latest missing" in r["no-latest"][0] and "iter_0000001" in r["no-latest"][0]
