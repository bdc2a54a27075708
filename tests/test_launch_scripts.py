"""The shell launch scripts assemble the right launcher (torchrun-argument) commands and refuse to guess addresses."""
import os
import shlex
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _run(script, env, **kw):
    full = {k: v for k, v in os.environ.items() if not k.startswith("SLURM_")}
    full.update(env)
    return subprocess.run(["bash", str(ROOT / script)], env=full, capture_output=True, text=True, timeout=60, **kw)


def _argv(out):
    return shlex.split(out.strip().splitlines()[-1])


def test_distributed_dry_run_static_rendezvous():
    p = _run("examples/pretrain_gpt_distributed.sh", {"DRY_RUN": "1", "NNODES": "2", "NODE_RANK": "1",
                                                      "MASTER_ADDR": "10.1.2.3", "GPUS_PER_NODE": "4", "TP": "4",
                                                      "PP": "2", "DATA_PATH": "/d/text", "TOKENIZER_MODEL": "/d/t.model"})
    assert p.returncode == 0, p.stderr
    argv = _argv(p.stdout)
    joined = " ".join(argv)
    assert argv[1:3] == ["-m", "megareshard.launch"]   # torchrun's arguments and agent, failures in one line
    assert "--nnodes 2 --node-rank 1 --nproc-per-node 4 --master-addr 10.1.2.3 --master-port 29500" in joined
    assert "--tensor-model-parallel-size 4 --pipeline-model-parallel-size 2" in joined
    assert "--data-path /d/text --tokenizer-model /d/t.model" in joined
    assert "--preflight-timeout 300 --comm-timeout 600" in joined
    assert argv.index("pretrain_gpt.py") > argv.index("--master-port")


def test_distributed_dry_run_c10d_and_cpu():
    p = _run("examples/pretrain_gpt_distributed.sh", {"DRY_RUN": "1", "NNODES": "3", "MASTER_ADDR": "head",
                                                      "RDZV": "c10d", "DEVICE": "cpu", "SEQUENCE_PARALLEL": "1"})
    joined = " ".join(_argv(p.stdout))
    assert "--rdzv-backend c10d --rdzv-endpoint head:29500" in joined and "--node-rank" not in joined
    assert "--device cpu" in joined and "--sequence-parallel" in joined and "--mock-data" in joined


def test_bad_flag_through_the_launch_script_is_one_line(tmp_path):
    """The script checks the arguments once, in one process, before torchrun starts a process per rank (each would
    print the line, then torchrun its traceback): one line, exit code 2, nothing started."""
    p = _run("examples/pretrain_gpt_distributed.sh", {"PYTHON": sys.executable, "DEVICE": "cpu", "GPUS_PER_NODE": "2",
                                                      "TP": "2", "PP": "1", "RUN_DIR": str(tmp_path / "run"),
                                                      "EXTRA_ARGS": "--tensor-model-paralel-size 2",
                                                      "PYTHONPATH": str(ROOT)}, cwd=tmp_path)
    assert p.returncode == 2, p.stdout + p.stderr
    assert p.stdout == "" and p.stderr.count("\n") == 1 and "Traceback" not in p.stderr, p.stderr
    assert p.stderr.startswith("pretrain_gpt.py: error: unknown flag(s) --tensor-model-paralel-size (did you mean "
                               "--tensor-model-parallel-size?)")
    assert not (tmp_path / "run").exists()


def test_distributed_refuses_localhost_fallback():
    p = _run("examples/pretrain_gpt_distributed.sh", {"DRY_RUN": "1", "NNODES": "2"})
    assert p.returncode == 2 and "MASTER_ADDR must name node 0's address" in p.stderr


def test_sbatch_needs_slurm():
    p = _run("examples/slurm/pretrain_gpt.sbatch", {})
    assert p.returncode == 2 and "submit with sbatch" in p.stderr


def test_sbatch_takes_master_from_allocation(tmp_path):
    # stand-ins for scontrol and srun: srun runs its command once per node, as SLURM would
    (tmp_path / "scontrol").write_text("#!/bin/bash\nprintf 'gpu-a17\\ngpu-a18\\n'\n")
    (tmp_path / "srun").write_text("#!/bin/bash\nshift\nfor n in 0 1; do SLURM_NODEID=$n DRY_RUN=1 \"$@\"; done\n")
    for f in ("scontrol", "srun"):
        (tmp_path / f).chmod(0o755)
    env = {"PATH": f"{tmp_path}:{os.environ['PATH']}", "SLURM_JOB_NODELIST": "gpu-a[17-18]", "SLURM_NNODES": "2",
           "SLURM_JOB_ID": "4242", "SLURM_SUBMIT_DIR": str(ROOT), "GPUS_PER_NODE": "8", "DRY_RUN": "1"}
    p = _run("examples/slurm/pretrain_gpt.sbatch", env)
    assert p.returncode == 0, p.stderr
    checks = [line for line in p.stdout.splitlines() if "--validate-only" in line]
    assert len(checks) == 1 and "WORLD_SIZE=16 LOCAL_WORLD_SIZE=8" in checks[0]  # once, before srun, for every node
    lines = [line for line in p.stdout.splitlines() if " -m megareshard.launch " in line]
    assert len(lines) == 2
    for node, line in enumerate(lines):
        assert f"--nnodes 2 --node-rank {node} --nproc-per-node 8 --master-addr gpu-a17 --master-port 24242" in line
    assert "rendezvous gpu-a17:24242" in p.stdout


def test_busy_master_port_is_one_line_before_torchrun_on_both_rendezvous_kinds(tmp_path):
    import socket
    import time

    with socket.socket() as held:            # someone else's server on the rendezvous port
        held.bind(("127.0.0.1", 0))
        held.listen()
        port = held.getsockname()[1]
        for rdzv in ("static", "c10d"):
            t0 = time.monotonic()
            p = _run("examples/pretrain_gpt_distributed.sh", {"NNODES": "1", "RDZV": rdzv, "MASTER_PORT": str(port),
                                                              "DEVICE": "cpu", "GPUS_PER_NODE": "2", "VALIDATE": "0",
                                                              "RUN_DIR": str(tmp_path / "run")})
            assert p.returncode == 1, (rdzv, p.stdout, p.stderr)
            lines = p.stderr.strip().splitlines()
            assert len(lines) == 1 and lines[0].startswith(f"error: MASTER_PORT {port} is already in use on "), lines
            assert f"(pid {os.getpid()}: " in lines[0] and len(lines[0]) < 400, lines[0]   # who holds it
            assert not (tmp_path / "run").exists() and time.monotonic() - t0 < 30   # nothing started
    from megareshard.launch.port_check import hosts_store

    assert hosts_store("static", 0, "10.255.1.2") and not hosts_store("static", 1, "127.0.0.1")
    assert hosts_store("c10d", 3, "localhost") and not hosts_store("c10d", 0, "10.255.1.2")   # only MASTER_ADDR's node
def test_ensure_venv_installs_the_extras_asked_for_and_keeps_the_others(tmp_path):
    """The quick start installs only what training needs (no test packages, no DeepSpeed); tests/run.sh asks for
    its extras; a later, smaller request reuses what is there."""
    (tmp_path / "tools").mkdir()
    (tmp_path / "tools/ensure_venv.sh").write_text((ROOT / "tools/ensure_venv.sh").read_text())
    for name in ("pyproject.toml", "constraints-cpu.txt"):
        (tmp_path / name).write_text("")
    venv_bin = tmp_path / ".venv/bin"
    venv_bin.mkdir(parents=True)
    log = tmp_path / "pip.log"
    (venv_bin / "python").write_text(f"#!/bin/bash\necho \"$*\" >> {log}\n")  # stands in for pip
    (venv_bin / "python").chmod(0o755)
    for f in ("tools/ensure_venv.sh", "pyproject.toml", "constraints-cpu.txt"):
        os.utime(tmp_path / f, (1e9, 1e9))  # older than the stamp each install writes

    def ensure(extras=None):
        env = {k: v for k, v in os.environ.items() if k != "MEGARESHARD_EXTRAS"}
        if extras is not None:
            env["MEGARESHARD_EXTRAS"] = extras
        subprocess.run(["bash", "-c", "source tools/ensure_venv.sh && echo $VENV_PY"], cwd=tmp_path, env=env,
                       check=True, capture_output=True, text=True)
        return log.read_text().splitlines() if log.exists() else []

    assert ensure()[-1].endswith(f"-e {tmp_path}[plots]")  # the examples' default: training and its pictures
    assert len(ensure("plots")) == 1  # nothing to do
    assert ensure("test,deepspeed,plots,hf")[-1].endswith(f"-e {tmp_path}[plots,test,deepspeed,hf]")
    assert "-c " in ensure()[-1] and len(ensure("hf")) == 2  # already there: no third install


def test_train_and_sample_dry_run():
    """examples/train_and_sample.sh: seven ranks (trainer tp 2 · pp 2, generators tp2,tp1) through the launcher;
    the command it prints is the one the argument check accepts."""
    p = _run("examples/train_and_sample.sh", {"DRY_RUN": "1"})
    assert p.returncode == 0, p.stderr
    check, launch = p.stdout.strip().splitlines()[-2:]
    assert check.startswith("WORLD_SIZE=7 LOCAL_WORLD_SIZE=7 ") and "--validate-only" in check
    argv = shlex.split(launch)
    joined = " ".join(argv)
    assert argv[1:3] == ["-m", "megareshard.launch"] and "--nproc-per-node 7" in joined
    assert "--generator-layouts tp2,tp1 --transfer-interval 5" in joined
    assert "--tensor-model-parallel-size 2 --pipeline-model-parallel-size 2" in joined
    from megareshard.arguments import parse_args
    cfg = parse_args(argv[argv.index("pretrain_gpt.py") + 1:], world_size=7)  # files are checked later
    assert cfg.plan.world_size == 4 and cfg.generators.generator_layouts == "tp2,tp1"
    p = _run("examples/train_and_sample.sh", {"DRY_RUN": "1", "GENERATORS": "tp1,tp1,tp1,tp1"})
    assert "--nproc-per-node 8" in p.stdout
