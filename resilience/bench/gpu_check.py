"""The CUDA path end to end, on one GPU, in a few minutes: what ``make gpu-check`` runs on a lent GPU machine.

    python -m resilience.bench.gpu_check [--out results/gpu_check/gpu.md] [--work results/gpu_check] [--only NAME,...]
    python -m resilience.bench.gpu_check --dry-run      # anywhere: the plan, every run's settings composed

Each check is a whole run as a user makes it (``python -m resilience ...`` on the GPU, its fault-free reference run
beside it: ``reference.check=run``) or, for the staging copy and NVML, a direct measurement. A check that fails
is a row that says so; the table (``--out``) names the device, driver, CUDA, torch and library versions. Written
for a machine whose own Python and torch differ from the lock (docs/gpu.md: how it is installed there): the torch
difference is declared in the table, and the declared torch workarounds run on it with
``RESILIENCE_UNCHECKED_RELEASES=1`` (each still named in its run's ``result.json``).
"""

from __future__ import annotations

import argparse
import importlib.metadata
import json
import os
import platform
import shutil
import statistics
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

from resilience.bench.experiment import write_table
from resilience.proc import child
from resilience.record.fsio import atomic_write_bytes

# a short training: 10 steps, a checkpoint every 4, the fault at step 6 (back to step 4)
SHORT = ["steps=10", "checkpoint.every=4", "seed=0", "fault.at_step=6"]
ONE_RANK = ["device=cuda", "backend=nccl", "world_size=1", "fault.rank=0"]
TWO_RANKS = ["device=cuda", "backend=gloo", "world_size=2", "fault.rank=1"]  # NCCL refuses two ranks on one GPU
RUN_TIMEOUT_S = 150  # the run and its fault-free reference run
ON_CPU = {"device=cuda": "device=cpu", "backend=nccl": "backend=gloo"}  # --rehearse: the same runs without a GPU


@dataclass
class Row:
    check: str
    verdict: str  # PASS | FAIL | ERROR | not run
    figure: str = ""
    note: str = ""


@dataclass
class RunCheck:
    """A whole run on the GPU and what its ``result.json`` must say."""

    name: str
    what: str
    overrides: list[str]
    expect: Callable[[dict], tuple[bool, str]] = field(default=lambda r: _recovered_exact(r))

    def run(self, work: Path, on_cpu: bool = False) -> Row:
        overrides = [ON_CPU.get(o, o) for o in self.overrides] if on_cpu else self.overrides
        run_dir = work / self.name
        shutil.rmtree(run_dir, ignore_errors=True)
        done = child.run(child.experiment_command([*overrides, "reference.check=run"], run_dir), RUN_TIMEOUT_S)
        run_dir.mkdir(parents=True, exist_ok=True)
        (run_dir / "stderr.txt").write_text(done.stderr)  # the harness's own failure, for the reproducer
        said = run_dir / "result.json"
        if not said.exists():
            return Row(self.name, "ERROR", note=f"exit {done.returncode}, no result.json; {_why(done.stderr, run_dir)}")
        result = json.loads(said.read_text())
        ok, figure = self.expect(result)
        return Row(self.name, "PASS" if ok else "FAIL", figure, _declared(result))


def _recovered_exact(r: dict) -> tuple[bool, str]:
    matches = (r.get("reference") or {}).get("matches")
    ok = r.get("status") == "ok" and bool(r.get("recovered")) and matches is True
    return ok, (f"recovered={r.get('recovered')} in {_s(r.get('recovery_time_s'))}, bit-exact={matches}, "
                f"stall {_s(r.get('ckpt_stall_s'))}, step {_s(r.get('step_time_s'))}")


def _bitflip_caught(r: dict) -> tuple[bool, str]:
    ok = (bool(r.get("detected")) and r.get("detector") == "replica_fingerprint" and bool(r.get("detected_rank_correct"))
          and _recovered_exact(r)[0])
    return ok, (f"detected by {r.get('detector')} on rank {r.get('detected_rank')} "
                f"(right rank: {r.get('detected_rank_correct')}); {_recovered_exact(r)[1]}")


def _nvrx_unpatched(r: dict) -> tuple[bool, str]:
    """NVRx on CUDA as shipped: recovered bit-exact with none of our CPU patches in force."""
    ok, figure = _recovered_exact(r)
    cpu_only = {"cuda_synchronize", "cpu_staging_copy"} & set(r.get("peer_patches") or [])
    return ok and not cpu_only, figure + (f"; CPU patches in force: {sorted(cpu_only)}" if cpu_only else "")


def _unpatched(r: dict) -> tuple[bool, str]:
    """A library on CUDA as shipped: recovered bit-exact with none of our CPU-only patches in force."""
    ok, figure = _recovered_exact(r)
    patches = list(r.get("peer_patches") or [])
    return ok and not patches, figure + (f"; patches in force: {patches}" if patches else "")


def _s(x: object) -> str:
    return f"{x:.3f} s" if isinstance(x, (int, float)) else str(x)


def _declared(r: dict) -> str:
    """What the run declares it changed in torch or a library (workarounds, patches in force)."""
    said = [f"{k}: {json.dumps(v)}" for k, v in sorted(r.items()) if ("workaround" in k or "patch" in k) and v]
    return "; ".join(said)


def _why(stderr: str, run_dir: Path) -> str:
    """The last error line the run printed, or wrote to a log."""
    texts = [("stderr", stderr)] + [(p.name, p.read_text(errors="replace")) for p in sorted(run_dir.glob("**/*.log"))]
    for where, text in texts:
        lines = [ln.strip() for ln in text.splitlines() if "Error" in ln or "error" in ln]
        if lines:
            return f"{where}: {lines[-1][:300]}"
    return "no error line in its output or logs"


RUNS = [
    RunCheck("gloo_cuda_2ranks_kill", "two ranks on one GPU over gloo, CUDA tensors; a rank killed, restarted",
             ["strategy=sync", "fault=kill", *TWO_RANKS, *SHORT]),
    RunCheck("nccl_1rank_kill", "one rank over NCCL; killed, restarted from its checkpoint",
             ["strategy=sync", "fault=kill", *ONE_RANK, *SHORT]),
    RunCheck("cuda_rng_real_loop", "the real loop (dropout draws the CUDA RNG, data loader): killed, resumed",
             ["train=real", "workload.dropout=0.1", "strategy=sync", "fault=kill", *ONE_RANK, *SHORT]),
    RunCheck("bitflip_cuda", "an exponent bit flipped in a CUDA weight of rank 1 of 3; rollback",
             ["fault=bitflip", "fault.target=weights", "fault.bit=exponent", "fault.rank=1", "fault.at_step=12",
              "recovery=rollback", "steps=20", "checkpoint.every=5", "seed=0", "world_size=3", "device=cuda",
              "backend=gloo", "detector=[process_exit,heartbeat,nonfinite,replica_fingerprint,ckpt_integrity]",
              # a fixed interval: `auto` at budget 0.01 decides ~16 steps on CUDA over gloo (a 7.6 ms check on a
              # 48 ms step), past this run's end; what is checked here is detection and rollback on CUDA
              "detectors.replica_fingerprint.every=2"],
             _bitflip_caught),
    RunCheck("async_cuda", "our async snapshot (pinned staging) on CUDA; killed, restarted",
             ["strategy=async", "fault=kill", *ONE_RANK, *SHORT]),
    RunCheck("inmemory_cuda", "in-memory checkpoint from CUDA tensors; a rank killed, loaded from memory",
             ["strategy=inmemory", "fault=kill", *TWO_RANKS, *SHORT]),
    RunCheck("dcp_async_staged_cuda", "DCP async save with its pinned, shared-memory stager (CUDA fast path)",
             ["strategy=dcp_async_staged", "fault=kill", *ONE_RANK, *SHORT]),
    RunCheck("torchsnapshot_cuda", "torchsnapshot async_take from CUDA tensors",
             ["strategy=torchsnapshot", "fault=kill", *ONE_RANK, *SHORT]),
    RunCheck("nvrx_async_cuda", "NVRx async checkpoint on CUDA: our CPU patches not in force",
             ["strategy=nvrx_async", "fault=kill", *ONE_RANK, *SHORT], _nvrx_unpatched),
    RunCheck("nvrx_async_dcp_cuda", "NVRx's DCP async path on CUDA: our CPU patches not in force",
             ["strategy=nvrx_async_dcp", "fault=kill", *ONE_RANK, *SHORT], _nvrx_unpatched),
    RunCheck("dlrover_flash_cuda", "DLRover Flash Checkpoint from CUDA tensors (shared memory, then disk)",
             ["strategy=dlrover_flash", "fault=kill", *ONE_RANK, *SHORT]),
    # its CUDA defaults: pinned staging, non-blocking copies, its metadata gather through CUDA tensors (the CPU
    # run's cpu_metadata_gather patch not in force); direct_io stays off as on the CPU (docs/peers.md)
    RunCheck("torch_checkpointing_cuda", "torch-checkpointing's async save from CUDA tensors, as shipped",
             ["strategy=torch_checkpointing", "fault=kill", *TWO_RANKS, *SHORT], _unpatched),
    RunCheck("jit_cuda", "just-in-time checkpoint: the survivor writes its CUDA replica at the kill",
             ["strategy=jit", "fault=kill", *TWO_RANKS, *SHORT]),
]


def staging_row() -> Row:
    """Device-to-host copy of gpt_small-sized state (about 0.5 GB): pinned against pageable host buffers."""
    import torch

    sizes = [64 * 2**20] * 8  # 8 tensors of 64 Mi float32: 2 GiB
    src = [torch.randn(n // 4, device="cuda") for n in sizes]
    pinned = [torch.empty(s.shape, pin_memory=True) for s in src]
    pageable = [torch.empty(s.shape) for s in src]
    for b in pageable:
        b.fill_(0)  # pages touched before timing, as a reserved buffer is

    def copy(bufs: list, non_blocking: bool) -> float:
        torch.cuda.synchronize()
        t = time.perf_counter()
        for b, s in zip(bufs, src):
            b.copy_(s, non_blocking=non_blocking)
        torch.cuda.synchronize()
        return time.perf_counter() - t

    times = {k: statistics.median(copy(b, nb) for _ in range(5)) for k, b, nb in
             (("pinned", pinned, True), ("pageable", pageable, False))}
    gb = sum(sizes) / 1e9
    ok = all(torch.equal(p, q) for p, q in zip(pinned, pageable)) and times["pinned"] < times["pageable"]
    fig = (f"{gb:.2f} GB: pinned {times['pinned'] * 1e3:.0f} ms ({gb / times['pinned']:.1f} GB/s), pageable "
           f"{times['pageable'] * 1e3:.0f} ms ({gb / times['pageable']:.1f} GB/s): {times['pageable'] / times['pinned']:.2f}x")
    return Row("d2h_staging", "PASS" if ok else "FAIL", fig, "median of 5; PASS: both copies equal, pinned faster")


def nvml_row() -> Row:
    """Our NVML detector (``gpu_health``) starts on the real device and polls it healthy."""
    from resilience.detectors.gpu_health import GpuHealth

    det = GpuHealth(every_s=0.0)
    why = det.start()
    if why:
        return Row("nvml_health", "FAIL", note=f"unavailable: {why}")
    found = det.on_poll([], time.monotonic() + 1)
    n = det._nvml
    h = det._handles[0]
    fig = (f"{len(det._handles)} GPU(s); {n.nvmlDeviceGetName(h)}; {n.nvmlDeviceGetTemperature(h, 0)} C; "
           f"ECC uncorrected, retired pages: {det._baseline[0]}; detections: {len(found)}")
    return Row("nvml_health", "PASS" if not found else "FAIL", fig)


DIRECT: dict[str, Callable[[], Row]] = {"d2h_staging": staging_row, "nvml_health": nvml_row}


def versions() -> list[str]:
    import torch

    lines = [f"python {platform.python_version()}", f"torch {torch.__version__} (the lock pins 2.13.0: "
             f"{'the same release' if torch.__version__.startswith('2.13.0') else 'a different release, declared'})",
             f"CUDA {torch.version.cuda}, NCCL {'.'.join(map(str, torch.cuda.nccl.version()))}"
             if torch.cuda.is_available() else "CUDA: none"]
    if torch.cuda.is_available():
        p = torch.cuda.get_device_properties(0)
        lines.append(f"device {p.name}, {p.total_memory / 2**30:.0f} GiB, {p.multi_processor_count} SMs, "
                     f"{torch.cuda.device_count()} visible")
    for pkg in ("nvidia-resiliency-ext", "dlrover", "torchsnapshot", "torchdata", "hydra-core", "nvidia-ml-py"):
        try:
            lines.append(f"{pkg} {importlib.metadata.version(pkg)}")
        except importlib.metadata.PackageNotFoundError:
            lines.append(f"{pkg}: not installed")
    return lines


def table(rows: list[Row], header: list[str], started: float) -> str:
    out = ["# GPU check (`make gpu-check`)", "", *[f"- {h}" for h in header],
           f"- {sum(r.verdict == 'PASS' for r in rows)} of {len(rows)} passed; {time.monotonic() - started:.0f} s", "",
           "| check | what | verdict | figure | declared |", "|---|---|---|---|---|"]
    what = {c.name: c.what for c in RUNS} | {"d2h_staging": "device-to-host copy, pinned vs pageable host memory",
                                             "nvml_health": "NVML (pynvml) health: our gpu_health detector"}
    out += [f"| `{r.check}` | {what.get(r.check, '')} | {r.verdict} | {r.figure} | {r.note} |" for r in rows]
    return "\n".join(out)


def dry_run(names: list[str]) -> int:
    """Compose every run's settings as ``python -m resilience`` would (a bad override fails here, on any machine)."""
    from resilience.config import CONF_DIR
    from resilience.settings.command_line import compose_checked

    for c in RUNS:
        if c.name in names:
            compose_checked(CONF_DIR, "config", [*c.overrides, "reference.check=run"])
            print(f"ok  {c.name}: python -m resilience {' '.join(c.overrides)} reference.check=run")
    for name in DIRECT:
        if name in names:
            print(f"ok  {name}: {DIRECT[name].__doc__.splitlines()[0]}")
    return 0


class Pass:
    """One pass over the checks: the direct measurements alone first, then the whole runs ``jobs`` at a time (a GPU
    machine has the cores, and a run spends most of its time starting processes); the table rewritten after each
    row, so that a pass cut off keeps what it measured. ``on_cpu``: the runs on device=cpu (``--rehearse``)."""

    def __init__(self, names: list[str], work: Path, out: Path, jobs: int, on_cpu: bool = False) -> None:
        self.names, self.work, self.out, self.jobs, self.on_cpu = names, work, out, jobs, on_cpu
        out.parent.mkdir(parents=True, exist_ok=True)  # --out need not lie under --work
        self.done: dict[str, Row] = {}
        self.started = time.monotonic()

    def run(self) -> list[Row]:
        for name in (n for n in self.names if n in DIRECT):
            self.one(name)
        with ThreadPoolExecutor(self.jobs) as pool:
            list(pool.map(self.one, [n for n in self.names if n not in DIRECT]))
        return [self.done[n] for n in self.names]

    def one(self, name: str) -> None:
        try:
            check = next((c for c in RUNS if c.name == name), None)
            row = check.run(self.work, self.on_cpu) if check else DIRECT[name]()
        except Exception as exc:  # one broken check is a row, the others still run
            row = Row(name, "ERROR", note=f"{type(exc).__name__}: {str(exc)[:300]}")
        self.done[name] = row
        print(f"[gpu-check {len(self.done)}/{len(self.names)}] {row.verdict} {name}: {row.figure} {row.note}",
              flush=True)
        rows = [self.done[n] for n in self.names if n in self.done]
        atomic_write_bytes(self.out, (table(rows, [], self.started) + "\n").encode())


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m resilience.bench.gpu_check", description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, default=Path("results/gpu_check/gpu.md"))
    ap.add_argument("--work", type=Path, default=Path("results/gpu_check"))
    ap.add_argument("--only", default="", help="comma-separated check names (default: all)")
    ap.add_argument("--dry-run", action="store_true", help="compose every run's settings; run nothing")
    ap.add_argument("--jobs", type=int, default=3, help="whole runs at a time (default 3)")
    ap.add_argument("--rehearse", action="store_true", help="the whole runs on the CPU (device=cpu, gloo)")
    args = ap.parse_args(argv)
    every = [c.name for c in RUNS] + list(DIRECT)
    names = [n for n in args.only.split(",") if n] or every
    if args.jobs < 1:
        ap.error(f"--jobs={args.jobs}: give at least 1")
    if unknown := sorted(set(names) - set(every)):
        ap.error(f"--only: unknown check(s) {', '.join(unknown)}; known: {', '.join(every)}")
    if args.dry_run:
        return dry_run(names)
    if args.rehearse:  # the same whole runs on the CPU: a setting no run takes shows here first
        return _exit(Pass([n for n in names if n not in DIRECT], args.work, args.out, args.jobs, on_cpu=True).run())
    import torch

    if not torch.cuda.is_available():
        print("error: no CUDA device here; gpu_check needs one (--dry-run checks the plan anywhere)")
        return 2
    os.environ.setdefault("RESILIENCE_UNCHECKED_RELEASES", "1")  # the runs inherit it
    check = Pass(names, args.work, args.out, args.jobs)
    rows = check.run()
    write_table(args.out, table(rows, versions(), check.started), check.started)
    return _exit(rows)


def _exit(rows: list[Row]) -> int:
    return 0 if all(r.verdict == "PASS" for r in rows) else 1


if __name__ == "__main__":
    raise SystemExit(main())
