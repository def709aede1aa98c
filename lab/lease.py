"""A lease on the H200 machine: a few device calls, one command each, JSON under $OUT.

Here (the CPU machine), before the lease:

    python -m lab.lease split-wheels .sglang-whl     # SGLang's wheels in four parts that each fit beside the tree
    python -m lab.lease serve-wheels                  # the serving calls' part gets minisgl's HTTP parser too
    python -m lab.lease plan                          # every call: its exact command, carry list and minutes

On the device, each call is one command (the plan prints them with the commit filled in):

    python3 -m lab.lease call1 --commit SHA          # minisgl Qwen3-0.6B: ceilings, headline + ablation, sweep
    python3 -m lab.lease call2 --commit SHA          # minisgl Qwen3.5 and Qwen3-8B, HF 0.6B and 8B
    python3 -m lab.lease call3 --commit SHA          # the profiler diagnoses and batch-1 timelines, 0.6B and 8B
    python3 -m lab.lease call4 --commit SHA          # SGLang on Qwen3-0.6B, Qwen3.5 and Qwen3-8B
    python3 -m lab.lease serving --commit SHA        # optional: online serving, both servers (issue 24)
    python3 -m lab.lease warmup --commit SHA         # optional: the kernel warm-up at engine start (issue 29)

SGLang's wheels (~50 MB) and the tree (~47 MB) do not fit in one call's 64 MiB, so each of calls 1-4 carries one
part (`a` to `d`; wheels over 8 MiB travel in pieces, joined on the machine): every call copies each part it
carries (any call may carry one where it has room: the plan says which fit) into /tmp/sglwhl on the machine, and
once every piece of the manifest is there the pieces are joined and the kit's run_sglang.sh unpacks the wheels
into /tmp/site. Calls 2-4 must therefore land on the machine call 1 warmed (a call within 30 s of the last one's
end). If one lands on a fresh machine, its SGLang steps are skipped with a message naming the missing parts, its
minisgl steps still run, and `--steps` re-runs what was skipped (`--steps none` only stages the parts carried:
e.g. `call1 --steps none`, `call2 --steps none`, `call3 --steps none` and then `call4` on a fresh machine).

Each step's output goes to /tmp/lease-logs/<step>.log; what the call wrote there is packed into
$OUT/logs_<call>.tar.xz at the end (xz: the request logs are most of a serving call's bytes). A step that would
run past the call's budget is skipped (said in the output), and one that overruns is stopped (SIGTERM, then
SIGKILL), so the JSON of every step that finished comes back, and a serving step stops its server. The device
returns at most 8 files a call: each call writes at most six JSON files and the logs.
"""

from __future__ import annotations

import argparse
import bisect
import collections
import glob
import json
import os
import re
import shutil
import signal
import site
import statistics
import subprocess
import sys
import tarfile
import time
from dataclasses import dataclass
from pathlib import Path

from lab import REPO

LOGS = Path("/tmp/lease-logs")
WHEELS = Path("/tmp/sglwhl")  # the carried parts, gathered on the machine across calls
SITE = Path("/tmp/site")  # where the kit's run_sglang.sh unpacks them (its stamp: /tmp/site/.sglang-kit)
KIT = ".sglang-kit"
WHEEL_DIR = ".sglang-whl"
MANIFEST = "MANIFEST.json"
CARRY_LIMIT = 64 << 20  # what one call may bring: tracked + untracked files + carried paths
CALL_LIMIT_S = 600  # the device's limit for one command
CALL_BUDGET_S = 520  # what a call plans to use: it must end, logs packed, before its timeout_s (540)
SERVER_GRACE_S = 6  # a server stopped by serve-bench: SIGTERM, then SIGKILL (inside STOP_GRACE_S below)
STOP_GRACE_S = 12  # a step stopped at the budget gets SIGTERM, then SIGKILL this much later (serve-bench stops its
#                    server in between: run16's serving step, killed outright, left SGLang's server answering)


# --- steps ---------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Step:
    """One thing a call does: a command with its log, an estimate of its seconds (from earlier leases' JSON:
    each section's `seconds`, SGLang's `engine_start_s` and `wall_s`) and the JSON files it writes."""

    name: str
    seconds: int
    files: tuple[str, ...] = ()

    def argv(self, out: str) -> list[str]:
        raise NotImplementedError

    def env(self) -> dict[str, str]:
        return {}

    def ready(self) -> str | None:
        """None when the step can run on this machine, else why not."""
        return None

    def prepare(self) -> None:
        """Make what the step needs on this machine, before `ready` is asked."""


@dataclass(frozen=True)
class Lab(Step):
    """`python -m lab.run` with some sections, into one JSON file."""

    sections: tuple[str, ...] = ()

    def argv(self, out: str) -> list[str]:
        return [sys.executable, "-m", "lab.run", "--out", out, "--file", self.files[0],
                "--sections", ",".join(self.sections)]


@dataclass(frozen=True)
class Timeline(Step):
    """`python -m lab.timeline`: the batch-1 decode step of a model, profiled."""

    model: str = "qwen3-0.6b"
    label: str = ""

    def argv(self, out: str) -> list[str]:
        return [sys.executable, "-m", "lab.timeline", "--out", out, "--model", self.model, "--label", self.label]


def kit_env() -> dict[str, str]:
    """The environment the kit's run_sglang.sh gives SGLang (its unpacked wheels, its stubs, the CUDA libraries of
    the machine's torch), with this repository on the path for the shared workloads."""
    nv = sorted({d for sp in site.getsitepackages() for pat in ("nvidia/*/lib", "nvidia/*/*/lib", "nvidia/cu13/lib")
                 for d in glob.glob(os.path.join(sp, pat)) if glob.glob(d + "/lib*.so*")})
    return {"PYTHONPATH": os.pathsep.join([str(SITE), str(REPO / KIT / "sgstub"), str(REPO)]),
            "LD_LIBRARY_PATH": os.pathsep.join([*nv, os.environ.get("LD_LIBRARY_PATH", "")]),
            "PYTHONUNBUFFERED": "1", "TOKENIZERS_PARALLELISM": "false", "HF_HUB_OFFLINE": "1",
            "SGLANG_SKIP_SGL_KERNEL_VERSION_CHECK": "1",
            "TVM_FFI_CACHE_DIR": os.environ.get("TVM_FFI_CACHE_DIR", "/tmp/jitcache"),
            "TRITON_CACHE_DIR": os.environ.get("TRITON_CACHE_DIR", "/tmp/tritoncache")}


@dataclass(frozen=True)
class SGLang(Step):
    """lab.sglang on one model under the kit's wheels (skipped when they are not all on this machine)."""

    model: str = "qwen3-0.6b"
    sections: tuple[str, ...] = ()

    def argv(self, out: str) -> list[str]:
        return [sys.executable, "-m", "lab.sglang", "--model", self.model, "--sections", ",".join(self.sections),
                "--out", os.path.join(out, self.files[0])]

    def env(self) -> dict[str, str]:
        return kit_env()

    def ready(self) -> str | None:
        return None if (SITE / ".sglang-kit").is_file() else wheels_missing()


@dataclass(frozen=True)
class Serving(Step):
    """Online serving, both servers one after the other (issue 24): SGLang's `bench_serving` client (the kit's
    serving.sh) against `python -m minisgl serve` and against SGLang's server, at each request rate. The servers'
    command lines are SERVERS below: the one place to change when minisgl's server gains flags."""

    loads: tuple[str, ...] = ("rate8", "rate24", "rate48", "burst")  # names of LOADS below
    servers: tuple[str, ...] = ("minisgl", "sglang")  # names of SERVERS below, in the order they run

    def ready(self) -> str | None:
        if not (SITE / ".sglang-kit").is_file():
            return wheels_missing()
        if not (REPO / WHEEL_DIR / "serve").is_dir():
            return f"{WHEEL_DIR}/serve is not carried (SGLang's HTTP server and client need it)"
        return None

    def argv(self, out: str) -> list[str]:
        return [sys.executable, "-m", "lab.lease", "serve-bench", "--out", out, "--loads", ",".join(self.loads),
                "--servers", ",".join(self.servers), "--name", self.name]


@dataclass(frozen=True)
class OwnClient(Step):
    """`python -m minisgl.bench.serving`: it starts minisgl's server on the serving model folder (the kit writes
    it), drives it at SGLang's loads, stops it, then runs the all-at-once load offline. `flags` go to the server
    (e.g. an A/B of a serve flag; `label` names the run: ours_<label>.json)."""

    label: str = "default"
    flags: tuple[str, ...] = ()

    def prepare(self) -> None:
        write_serve_model()
        unpack_serve_part()

    def ready(self) -> str | None:
        # the device's python has no fastapi/uvicorn (run26: the server exited at once without them)
        missing = http_site_missing()
        if missing:
            return missing
        return None if (Path(SERVE_MODEL) / "config.json").is_file() else f"could not write {SERVE_MODEL}"

    def env(self) -> dict[str, str]:
        return server_env("minisgl")

    def argv(self, out: str) -> list[str]:
        return [sys.executable, "-m", "minisgl.bench.serving", "--model", SERVE_MODEL, "--label", self.label,
                "--rates", "8,24,48,inf", "--offline", "--out", os.path.join(out, f"ours_{self.label}.json"), "--",
                "--load-format", "dummy", *self.flags]


@dataclass(frozen=True)
class Check(Step):
    """`python -m lab.checks.<module> --out DIR` with the module's own arguments: a check that writes its JSON."""

    module: str = ""
    args: tuple[str, ...] = ()

    def argv(self, out: str) -> list[str]:
        return [sys.executable, "-m", f"lab.checks.{self.module}", "--out", out, *self.args]


@dataclass(frozen=True)
class FrontCheck(Step):
    """`python -m lab.checks.front`: the server's front alone on this machine's CPU (a fake engine process, no
    GPU), 512 text prompts at once as SGLang's client sends them: how fast the front takes a burst in and how
    many streamed tokens a second it delivers on the serving machine's cores. Its FastAPI and uvicorn come from
    the wheels the serving step unpacks, so it runs after that step."""

    def ready(self) -> str | None:
        return http_site_missing()

    def env(self) -> dict[str, str]:
        return server_env("minisgl")

    def argv(self, out: str) -> list[str]:
        return [sys.executable, "-m", "lab.checks.front", os.path.join(out, self.files[0]), "--text",
                "--repeat", "1"]


# xgrammar for issue 26's check (the structured-output arms): its wheel for the device's Python and the wheels it
# imports that the kit already has, unzipped into API_SITE on the device (a wheel is a zip of its files)
API_WHEELS = f"{WHEEL_DIR}/api"
API_SITE = Path("/tmp/site-api")
API_FROM_KIT = ("apache_tvm_ffi-", "pydantic-", "pydantic_core-", "annotated_types-", "typing_inspection-")


# The HTTP parser minisgl's `serve` extra installs (pyproject.toml): the device has neither it nor uvicorn, so both
# servers take uvicorn from the kit's wheels and httptools from the `serve` part. SGLang's server (uvicorn too, its
# `http` left at auto) picks it up as ours does: the two fronts keep one environment.
SERVE_EXTRA = ("httptools==0.9.0",)


SERVE_EXTRA_PREFIXES = tuple(spec.split("==")[0] + "-" for spec in SERVE_EXTRA)  # their wheels' file names


def download_device_wheels(specs: tuple[str, ...], dest: Path) -> None:
    """Download the wheels of `specs` (no dependencies) for the device's Python (cp312, x86-64) into `dest`."""
    subprocess.run([sys.executable, "-m", "pip", "download", *specs, "--no-deps", "--python-version", "3.12",
                    "--only-binary=:all:", "--platform", "manylinux_2_28_x86_64", "-d", str(dest), "-q"], check=True)


def serve_wheels(root: Path = REPO) -> list[str]:
    """Here, before a lease: add the cp312 wheels of SERVE_EXTRA to .sglang-whl/serve (the kit's prepare_wheels.sh
    fills the rest); returns the names added or already there."""
    dest = root / WHEEL_DIR / "serve"
    if not dest.is_dir():
        raise SystemExit(f"{dest} is missing: bash ../shared/sglang-kit/prepare_wheels.sh {WHEEL_DIR} first")
    download_device_wheels(SERVE_EXTRA, dest)
    return sorted(f.name for f in dest.glob("*.whl") if f.name.startswith(SERVE_EXTRA_PREFIXES))


def api_wheels(root: Path = REPO) -> list[str]:
    """Here, before a lease: fill .sglang-whl/api with xgrammar's cp312 wheel (from the registry) and its imports
    from the kit's wheels (prepare_wheels.sh's folder); returns the names."""
    dest = root / API_WHEELS
    dest.mkdir(parents=True, exist_ok=True)
    download_device_wheels(("xgrammar==0.2.9",), dest)
    for f in (root / WHEEL_DIR).glob("*.whl"):
        if f.name.startswith(API_FROM_KIT) and not (dest / f.name).exists():
            shutil.copy2(f, dest / f.name)
    return sorted(f.name for f in dest.glob("*.whl"))


@dataclass(frozen=True)
class ApiCheck(Step):
    """lab.checks.h200_api_check (issue 26's bars), with xgrammar importable when .sglang-whl/api is carried."""

    def prepare(self) -> None:
        unzip_wheels(REPO / API_WHEELS, API_SITE)

    def env(self) -> dict[str, str]:
        return {"PYTHONPATH": os.pathsep.join([str(API_SITE), str(REPO)])}

    def argv(self, out: str) -> list[str]:
        return [sys.executable, "-m", "lab.checks.h200_api_check", out]


def unzip_wheels(folder: Path, site: Path) -> None:
    """Every wheel in `folder` unzipped into `site` (a wheel is a zip of its files), once: `site/.done` says so."""
    import zipfile
    if (site / ".done").is_file():
        return
    for f in sorted(folder.glob("*.whl")):
        with zipfile.ZipFile(f) as z:
            z.extractall(site)
    site.mkdir(parents=True, exist_ok=True)
    (site / ".done").write_text("")


# --- calls ---------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Call:
    about: str
    carry: tuple[str, ...]
    steps: tuple[Step, ...]
    budget_s: int = CALL_BUDGET_S

    @property
    def seconds(self) -> int:
        return sum(s.seconds for s in self.steps) + 20  # + python and CUDA start, staging, packing the logs


# Estimates (seconds) from the logs of run15 (a fresh machine; the engine warms its kernels at start): minisgl06
# 330 s plus ~25 s for the default measured again, sglang06 213 s, minisgl35 57 s, sglang35 96 s, sglang8 159 s,
# minisgl8 235 s plus ~30 s, the 0.6B profiles 87 s and the 8B ones 36 s (plus a process start each), the timelines
# 40 and 55 s. run15's call 3 held all of Qwen3-8B and both profiles, ~620 s: more than a call's budget.
# SGLang's wheels travel in four parts (run16: the tree grew to 38.4 MiB, and two halves of 25 MiB left <1 MiB of
# room; run26: at 47 MiB three parts of 16.3 left 0.7 MiB), one a call; SGLang's steps all run in call 4, once the
# four are on the machine.
# issue 29's sweep in a fresh process: a call of its own, and the first step of `gemv`
WARMUP_SWEEP = Lab("warmup_sweep", 170, ("warmup_sweep.json",), ("warmup_sweep",))
# run13 (H200, three tables): 96 s and 191 s; elsewhere a fourth table (the H200's) adds a W2 arm
WIDE_AB06 = Lab("wide_ab06", 125, ("wide06.json",), ("wide_ab06",))
WIDE_AB8 = Lab("wide_ab8", 240, ("wide8.json",), ("wide_ab8",))
FOLD_SUMS06_W2 = Lab("fold_sums06_w2", 100, ("fold_sums06_w2.json",), ("fold_sums06_w2",))
# issue 29's quick probes: each a call of its own, and together the `probes` call
ROPE_BITS = Check("rope_bits", 40, ("fused_rope_bits.json",), module="fused_rope_bits")
ROPE_TOKENS = Lab("rope_tokens06", 80, ("rope_tokens06.json",), ("rope_tokens06",))
MEGAKERNEL = Check("megakernel", 180, ("decode_megakernel.json",), module="decode_megakernel")
# the stamped chain (boundaries) adds four compiles and two graphs: ~15 s, a guess until timed
ANATOMY = Check("anatomy", 75, ("decode_anatomy.json",), module="decode_anatomy")  # run30 (H100): 43 s
ANATOMY8 = Check("anatomy8", 135, ("decode_anatomy.json",), module="decode_anatomy",
                 args=("--models", "qwen3-8b"))  # run33 (H100): 99 s with every probe
# 150 s of candidates, the engine's start and W2 twice on Qwen3-8B (run32's wide_ab8 ran W2 four times in ~200 s)
STEP_TILES8 = Lab("step_tiles8", 330, ("step_tiles8.json",), ("step_tiles8",))
# the 0.6B candidates time quickly: run34 (H100) tuned for 30 s of its 150 and ran in 105 s with W2 twice
STEP_TILES06 = Lab("step_tiles06", 150, ("step_tiles06.json",), ("step_tiles06",))
BARRIER = Check("barrier", 60, ("grid_barrier.json",), module="grid_barrier")
PERSISTENT = Check("persistent", 90, ("persistent_gemv.json",), module="persistent_gemv")
FOLD8 = Lab("fold8", 300, ("fold8.json",), ("fold8",))
TIMELINE06 = Timeline("timeline06", 40, ("decode_timeline_06.json",), "qwen3-0.6b", "06")
TIMELINE8 = Timeline("timeline8", 55, ("decode_timeline_8b.json",), "qwen3-8b", "8b")
# the full lease: the headline, its diagnoses and SGLang beside it
HEADLINE_CALLS = ("call1", "call2", "call3", "call4")
CALLS: dict[str, Call] = {
    "call1": Call(
        "minisgl Qwen3-0.6B at this commit: the card's ceilings, the headline workloads and the ablation table "
        "(each switch off in turn), the batch-mix sweep, and the batch-1 step's timeline",
        carry=(KIT, f"{WHEEL_DIR}/a"),
        steps=(Lab("minisgl06", 360, ("qwen3_06.json",), ("ceilings", "bench06", "sweep06")),
               TIMELINE06)),
    "call2": Call(
        "minisgl on Qwen3.5-0.8B and Qwen3-8B (headline and ablations), transformers on Qwen3-0.6B and 8B",
        carry=(KIT, f"{WHEEL_DIR}/b"),
        steps=(Lab("minisgl35", 60, ("qwen35_hf06.json",), ("qwen35", "hf06")),
               Lab("minisgl8", 265, ("qwen3_8b.json",), ("bench8", "hf8")))),
    "call3": Call(
        "the profiler diagnoses: Qwen3-0.6B (W1 slices with each switch, batch-1/64 decode) and Qwen3-8B, and "
        "Qwen3-8B's batch-1 step timeline",
        carry=(KIT, f"{WHEEL_DIR}/c"),
        steps=(Lab("diagnosis", 95, ("diagnosis.json",), ("profile",)),
               Lab("diagnosis8", 45, ("diagnosis8.json",), ("profile8",)),
               TIMELINE8)),
    "call4": Call(
        "SGLang beside us, on the machine calls 1-3 staged their parts on: Qwen3-0.6B (W1, W1 top-k/top-p, W2, "
        "W3, W4, the sweep), Qwen3.5-0.8B (W1, W2), Qwen3-8B (W1, W1 top-k/top-p, W2)",
        carry=(KIT, f"{WHEEL_DIR}/d"),
        steps=(SGLang("sglang06", 215, ("sglang_06.json",), "qwen3-0.6b", ("w1", "w1_topkp", "w2", "w3", "w4",
                                                                          "sweep")),
               SGLang("sglang35", 100, ("sglang_35.json",), "qwen3.5-0.8b", ("w1", "w2")),
               SGLang("sglang8", 160, ("sglang_8.json",), "qwen3-8b", ("w1", "w1_topkp", "w2")))),
    # run16: minisgl's server took 326 s for the four loads (66 s to start, ~28 s of client start a load beside the
    # runs themselves), SGLang's ~100 s to start: both in one call overran its budget. The client now starts once
    # per server (lab.serve_client): ~190 + ~210 s, then ~50 s offline.
    "serving": Call(
        "optional, on a machine calls 1-4 staged (or carry the last part along): online serving (issue 24), "
        "minisgl's server and then SGLang's under SGLang's bench_serving client at 8, 24, 48 requests/s and 512 "
        "at once, then the all-at-once requests through the offline engine (the server/offline ratio); last, the "
        "front alone on the machine's CPU (lab.checks.front: a fake engine, no GPU; cut first if time runs out)",
        carry=(KIT, f"{WHEEL_DIR}/serve"),
        steps=(Serving("serving", 460, ("serving.json", "serving_minisgl.jsonl", "serving_sglang.jsonl")),
               FrontCheck("front", 25, ("front.json",)))),
    "burst": Call(
        "optional, on a machine calls 1-4 staged (or carry the last part along): issue 24's all-at-once load alone, "
        "both servers under SGLang's client, then the same requests offline; then the front alone (lab.checks.front)",
        carry=(KIT, f"{WHEEL_DIR}/serve"),
        steps=(Serving("burst", 250, ("burst.json", "burst_minisgl.jsonl", "burst_sglang.jsonl"), loads=("burst",)),
               FrontCheck("front", 25, ("front.json",)))),
    "settle24": Call(
        "optional, on a machine calls 1-4 staged (or carry the last part along): issue 24's bars in one call: "
        "minisgl's server at its defaults, SGLang's, then minisgl's with the burst's mixed steps eager (prefill "
        "graphs up to 4,096 tokens x 64 requests, the extend kernel's grid: the defaults before run25), each at "
        "24/s, 48/s and all at once under SGLang's client (minisgl's with its request log: where each request's "
        "time went); then the burst's requests offline (the server/offline ratio)",
        carry=(KIT, f"{WHEEL_DIR}/serve"),
        # run25 (H200): the whole call 328 s, the offline run included. The order cuts the third arm and the
        # offline run first.
        steps=(Serving("settle24", 400, ("settle24.json", "settle24_minisgl.jsonl", "settle24_sglang.jsonl",
                                         "settle24_minisgl_eager_mixed.jsonl"),
                       loads=("rate24", "rate48", "burst"),
                       servers=("minisgl", "sglang", "minisgl_eager_mixed")),)),
    "mixed": Call(
        "optional: issue 24's burst on the engine alone: Qwen3-0.6B on the 512-request mix, each step's host time "
        "by phase (schedule, launch, wait for the device) and each step synchronised and timed; run23's burst "
        "took ~50 ms a mixed step for 8k and for 16k prompt tokens alike",
        carry=(),
        steps=(Lab("mix_phases06", 100, ("mix_phases06.json",), ("mix_phases06",)),)),
    "launch": Call(
        "optional: issue 24's burst on the engine alone, host side: Qwen3-0.6B on the 512-request mix with every step "
        "launched on an idle device (host launch time against device time, by how the step ran) and the prefill "
        "launches under cProfile (the mixed steps in prefill graphs at the defaults), then the same with them eager "
        "(the defaults before run25); run23's mix took ~20 ms to launch an eager mixed step",
        carry=(),
        steps=(Lab("launch06", 180, ("launch06.json",), ("launch06", "launch06_eager")),)),
    "tiles_offline": Call(
        "optional: the extend kernel from a tile list (extend_tiles) against its grid: the kernel alone in "
        "prefill-graph shapes, then Qwen3-0.6B's W1, W3 and W4, two rounds interleaved, and the prefill graphs "
        "against eager steps with the grid (with the tile list, the default, that is prefill_check)",
        carry=(),
        steps=(Lab("tiles_ab06", 330, ("tiles_ab06.json",),
                   ("extend_tiles_check", "tiles_ab06", "prefill_check_grid")),)),
    "tiles_check": Call(
        "optional: the extend kernel from a tile list against its grid, the kernel alone in prefill-graph shapes "
        "(tiles_offline's first section; run25: 4 of 4 ok)",
        carry=(),
        steps=(Lab("extend_tiles_check", 90, ("extend_tiles_check.json",), ("extend_tiles_check",)),)),
    "warmup": Call(
        "optional: issue 29, the kernel warm-up: engine start with it on and off (empty and reused Triton caches), "
        "compiles inside W1/W2, the first W1 generate against the second and against a second engine's first, with "
        "where each one's time went, a start under cProfile; Qwen3-0.6B, and Qwen3.5-0.8B's cold start; a "
        "process each",
        carry=(),
        # run17: the 0.6B arms 116 + 80 + 63 s, Qwen3.5's cold one 115 s; the profiled start ~60 s
        steps=(Lab("warmup", 450, ("warmup.json",), ("warmup_check",)),)),
    "warmup_sweep": Call(
        "optional: issue 29, a fresh process with the kernel warm-up on and an empty Triton cache through W1, W2 and "
        "the batch-mix sweep: the kernels compiled inside any of them (target: none)",
        carry=(),
        steps=(WARMUP_SWEEP,)),
    "gemv": Call(
        "optional: the decode GEMV tuned again with the down projections timed as the engine runs them (the "
        "activation folded in) and batch-1 decode (W2) with the repo's table against the new picks (and, on another "
        "card, the H200's table), two rounds each, Qwen3-0.6B then Qwen3-8B (issue 29's sweep in a fresh process, "
        "which this call began with before run31: warmup_sweep)",
        carry=(),
        steps=(WIDE_AB06, WIDE_AB8)),
    "gemv06": Call(
        "optional: the gemv call's Qwen3-0.6B part alone (the GEMV tuned, then W2 with the card's table against the "
        "picks, two rounds); on an H100, which has no table, run28's megakernel check saw the H200 table's tiles take "
        "the engine's layers from 909 to 827 us",
        carry=(),
        steps=(WIDE_AB06,)),
    "fold_sums_w2": Call(
        "optional: a session's last minutes: Qwen3-0.6B's W2 unfolded, folded, and folded with the sums handed on, one "
        "round (run31's next32 stopped before fold_sums06 wrote its JSON)",
        carry=(),
        steps=(FOLD_SUMS06_W2,)),
    "next33": Call(
        "optional, a session's first call, best on an H100 (no tuned GEMV table in the repo: the tiles come from "
        "gemv_config's rule; run28 saw the H200 table's tiles take the 0.6B layers from 909 to 827 us there): the "
        "decode GEMV tuned on this card and W2 with the repo's table against the picks and the H200's table, "
        "Qwen3-0.6B and Qwen3-8B (the gemv call), then fold_sums_w2",
        carry=(),
        steps=(WIDE_AB06, WIDE_AB8, FOLD_SUMS06_W2)),
    "act": Call(
        "optional, issue 29: the MLP's SiLU-and-mul in the epilogue of the gate_up GEMV (kernel option "
        "gemv_act_epilogue; run32's chain tune on an H200 timed Qwen3-8B's down GEMV at 35.7 us with the activation "
        "in every program against 27.5 without; on by default since run32): the batch-1 step's anatomy of "
        "Qwen3-0.6B and Qwen3-8B (probe folded_down_act), then Qwen3-8B's tokens off and on (greedy and seeded "
        "sampling, batch 1 and 8, graphs and eager) and W2 off and on, one round",
        carry=(),
        steps=(Check("anatomy_both", 120, ("decode_anatomy.json",), module="decode_anatomy",
                     args=("--models", "qwen3-0.6b,qwen3-8b")),  # run32 (H200): 36 s and 65 s
               # as fold8's two arms (run31's fold_sums8 took 307 s for three)
               Lab("act8", 300, ("act8.json",), ("act8",)))),
    "act06": Call(
        "optional: the same A/B on Qwen3-0.6B, W2 in two rounds", carry=(),
        steps=(Lab("act06", 200, ("act06.json",), ("act06",)),)),
    "prefetch8": Call(
        "optional, issue 29: Qwen3-8B's GEMVs with the next weight tile's load issued before the current tile's "
        "products (kernel option gemv_prefetch; Triton pipelines none of these loads: the down projection's "
        "six-tile loop waits on each load): the batch-1 step's anatomy (probe folded_prefetch), then tokens off "
        "and on (greedy and seeded sampling, batch 1 and 8, graphs and eager) and W2 off and on, one round",
        carry=(),
        steps=(ANATOMY8, Lab("prefetch8", 300, ("prefetch8.json",), ("prefetch8",)))),  # as act8: run32 (H100) 226 s
    "gemv_stages": Call(
        "optional, issue 29: Qwen3-8B's GEMV K loops pipelined by Triton through shared memory (kernel option "
        "gemv_stages; the down projection's six-tile loop waits on each load at 1): the batch-1 step's anatomy "
        "(probes folded_stages2 and folded_stages3; the chains of looped kinds at 3 stages too), then tokens at 1 "
        "and 3 stages (greedy and seeded sampling, batch 1 and 8, graphs and eager) and W2 at each, one round",
        carry=(),
        steps=(ANATOMY8, Lab("gemv_stages8", 300, ("gemv_stages8.json",), ("gemv_stages8",)))),  # as prefetch8
    "step_tiles8": Call(
        "optional, issue 29: Qwen3-8B's decode GEMV tiles tuned inside its batch-1 step (lab.tune.gemv_step: each "
        "GEMV kind's candidates in the step's graph, replayed on a live request; run32's standalone picks made W2 "
        "8% slower on an H200), at most 150 s of candidates, then W2 with the card's table and with the picks, one "
        "round",
        carry=(),
        steps=(STEP_TILES8,)),
    "step_tiles06": Call(
        "optional: the same on Qwen3-0.6B (at most 150 s of candidates), W2 in two rounds", carry=(),
        steps=(STEP_TILES06,)),
    "step_tiles": Call(
        "optional, issue 29's two bars in one call: step_tiles06 then step_tiles8 (both models' tiles picked in "
        "the step, W2 at the card's table and at the picks)",
        carry=(),
        steps=(STEP_TILES06, STEP_TILES8)),
    "decode_mid": Call(
        "optional: Qwen3-0.6B's decode step at 1-16 requests of 1k-token prompts under the profiler (run26, H100: "
        "1.0, 1.64, 2.24 ms a step at 1, 4, 16), then the decode attention's split count (kernel option "
        "decode_split_waves 2, 4, 8) at 1-16 requests of 1k- and 4k-token prompts, two rounds, tokens counted",
        carry=(),
        steps=(Check("decode_mid", 150, ("decode_mid.json",), module="decode_mid"),)),  # run26: profile 25 s
    "anatomy": Call(
        "optional: issue 29, where a batch-1 decode step's time goes: its graph captured again with each part taken "
        "out (norms, RoPE, attention, GEMVs, lm_head) and with each launch-time kernel option moved (PDL, split "
        "waves, fused merge, early keys and metadata, the GEMV's early tiles), replayed on a live request; each "
        "GEMV kind chained over the layers (its bandwidth) and a chain of one-row RMSNorms; a layer's GEMVs chained "
        "with every program stamped (when it began, its wait returned, it ended: what each kernel boundary costs), "
        "and the whole step at its defaults so stamped, the attention's two launches included; Qwen3-0.6B "
        "(lab.checks.decode_anatomy; run27 on an H100: ~36 s)",
        carry=(),
        steps=(ANATOMY,)),
    "anatomy8": Call("optional: the same on Qwen3-8B", carry=(),
                     steps=(ANATOMY8,)),
    "mlp_prefetch": Call(
        "optional, issue 29: the MLP's L2 prefetch (kernel option gemv_mlp_prefetch_mb: each layer's o GEMV asks L2 "
        "for the MLP's weights before its PDL wait, while the attention runs and HBM idles): Qwen3-0.6B's anatomy "
        "(probes folded_mlp_prefetch8 and 24, the stamped step), then tokens off and at 24 MiB (greedy and seeded "
        "sampling, batch 1 and 8, graphs and eager) and W2 at each, two rounds", carry=(),
        # as act06 (200 s) after the anatomy (run40 on an H100: 76 s)
        steps=(ANATOMY, Lab("mlp_prefetch06", 200, ("mlp_prefetch06.json",), ("mlp_prefetch06",)))),
    "next_kv": Call(
        "optional, issue 29: each decode program asks L2 for the next layer's keys and values at its first key tile "
        "before its PDL wait (kernel option decode_prefetch_next_kv; run40's stamps had Qwen3-8B's new-token split "
        "wait ~5 us for its early tile): Qwen3-8B's anatomy (probe folded_prefetch_next_kv, the stamped step), then "
        "tokens off and on (greedy and seeded sampling, batch 1 and 8, graphs and eager) and W2 at each, one round",
        carry=(),
        steps=(ANATOMY8, Lab("next_kv8", 300, ("next_kv8.json",), ("next_kv8",)))),  # as gemv_stages
    "stamps": Call(
        "optional, issue 29: the anatomy's stamped step alone (each GEMV and attention program's begin, wait and "
        "end, stage 1's phases by split: q ready, early key tile in registers, softmax, values), Qwen3-0.6B and "
        "Qwen3-8B", carry=(),
        # run40 (H100): the whole anatomy took 76 s and 104 s, of which the stamped step a fraction
        steps=(Check("stamps", 90, ("decode_anatomy.json",), module="decode_anatomy",
                     args=("--models", "qwen3-0.6b,qwen3-8b", "--parts", "step_stamps")),)),
    "staged": Call(
        "optional, issue 29: a decode graph's inputs staged in one copy (engine switch graph_staged_inputs) off and "
        "on: Qwen3-0.6B's tokens, W2 and W1 twice interleaved, Qwen3-8B's W2 once, Qwen3.5-0.8B's tokens and W2 "
        "once; then Qwen3-0.6B's batch-1 timeline at the defaults (the engine's time a step against its graphs "
        "replayed bare)",
        carry=(),
        # run35 (H100): staged06 + staged8 in 225-233 s
        steps=(Lab("staged", 320, ("staged.json",), ("staged06", "staged8", "staged35")), TIMELINE06)),
    "fused_ends": Call(
        "optional, issue 29: the sampler's ends fused (kernel option sampler_fused_ends: its row settings in one "
        "kernel, its last reduction and the token-table write in another, a greedy graph's argmax by its draw pass) "
        "off and on: Qwen3-0.6B's tokens under graphs and eagerly, W2, W2 top-k/top-p and W1 twice interleaved, "
        "Qwen3-8B's W2 and W2 top-k/top-p once; then Qwen3-0.6B's batch-1 timeline at the defaults",
        carry=(),
        # run36 (H100): fused_ends06 + fused_ends8 in 305 s
        steps=(Lab("fused_ends", 330, ("fused_ends.json",), ("fused_ends06", "fused_ends8")), TIMELINE06)),
    "zero_copy": Call(
        "optional, issue 29: a step's boundary without the copy engine (kernel option zero_copy_io: a staged step's "
        "inputs read from pinned memory by one kernel, its tokens written there by another) off and on: "
        "Qwen3-0.6B's tokens under graphs and eagerly, W2 and W1 twice interleaved, Qwen3-8B's W2 once; then "
        "Qwen3-0.6B's batch-1 timeline at the defaults",
        carry=(),
        steps=(Lab("zero_copy", 260, ("zero_copy.json",), ("zero_copy06", "zero_copy8")), TIMELINE06)),
    "fused_narrow": Call(
        "optional, issue 29: the top-k/top-p search's narrowing in each pass's last program (kernel option "
        "sampler_fused_narrow, on by default since run38) off and on: Qwen3-0.6B's tokens under graphs and "
        "eagerly, W2 and W1 with top-k/top-p twice interleaved, Qwen3-8B's W2 top-k/top-p once",
        carry=(),
        steps=(Lab("fused_narrow", 300, ("fused_narrow.json",), ("fused_narrow06", "fused_narrow8")),)),
    "timelines": Call(
        "optional: issue 29, the batch-1 step with the host around it: Qwen3-0.6B's and Qwen3-8B's timelines (the "
        "engine's unprofiled time a step against its graphs replayed bare, the host's phases), as calls 1 and 3 "
        "take them",
        carry=(),
        steps=(TIMELINE06, TIMELINE8)),
    "probes": Call(
        "optional, a session's first call: issue 29's quick probes in one call: the fused RoPE against the RoPE "
        "kernel bit by bit (rope_bits) and in the engine's tokens (rope_tokens06), the batch-1 step's anatomy, the "
        "grid barrier against a kernel boundary, Qwen3-0.6B's GEMV chain in one persistent kernel against the "
        "engine's launches",
        carry=(),
        steps=(ROPE_BITS, ROPE_TOKENS, ANATOMY, BARRIER, PERSISTENT)),
    "megakernel": Call(
        "optional: issue 29, every decoder layer of a batch-1 step in one persistent kernel (phases with grid "
        "barriers between: norm+qkv, attention splits with the fused RoPE and store, merge, o, norm+gate_up, down), "
        "on a live Qwen3-0.6B request: the first layer whose output differs from the engine's ops and that layer "
        "phase by phase, then per GEMV tile set the same bits as the engine's ops with those tiles? its time against "
        "theirs and the engine's step, and each phase's time from the kernel's own stamps "
        "(lab.checks.decode_megakernel; run28: 66-142 s)",
        carry=(),
        steps=(MEGAKERNEL,)),
    "boundaries": Call(
        "optional, issue 29, a session's first call: where a batch-1 step's kernel boundaries go, two ways: the "
        "megakernel call (its `share` tiles, each program's whole share of a matmul loaded across the barrier before "
        "it, and `arrive_first`; run39 on an H100: bit-equal, slower than the launches), then the anatomy call "
        "(Qwen3-0.6B's layer GEMVs chained with every program stamped)",
        carry=(),
        steps=(MEGAKERNEL, ANATOMY)),
    "mega_ab": Call(
        "optional: issue 29, the engine with the decode-layers kernel (kernel option decode_megakernel) off, on, and "
        "on with 168 registers a thread: tokens (greedy and seeded sampling, batch 1 and 8, graphs and eager), then "
        "W2, two rounds; Qwen3-0.6B",
        carry=(),
        steps=(Lab("megakernel06", 420, ("megakernel06.json",), ("megakernel06",)),)),
    "mega_ab8": Call("optional: the same on Qwen3-8B, one round", carry=(),
                     steps=(Lab("megakernel8", 480, ("megakernel8.json",), ("megakernel8",)),)),
    "persistent": Call(
        "optional: issue 29, a model's batch-1 GEMV chain (every layer's qkv, o, gate_up, down) in one persistent "
        "kernel with grid barriers, its next weights loaded before each barrier, against the engine's PDL-chained "
        "gemv() launches; tiles and programs per SM swept; Qwen3-0.6B and Qwen3-8B (lab.checks.persistent_gemv)",
        carry=(),
        steps=(Check("persistent2", 200, ("persistent_gemv.json",), module="persistent_gemv",
                     args=("--models", "qwen3-0.6b,qwen3-8b")),)),
    "barrier": Call(
        "optional: issue 29, a dependent phase's cost as a PDL kernel boundary (bare, and with a GEMV's 8 KB of "
        "early-loaded weights a program) against a grid barrier inside one persistent kernel, 132-1,056 programs "
        "(lab.checks.grid_barrier; the case for a persistent decode-layer kernel)",
        carry=(),
        steps=(BARRIER,)),
    "rope_bits": Call(
        "optional: where the fused RoPE parts from the RoPE kernel on the GPU (its tokens differed in run25 and "
        "run26, equal under the CPU interpreter): one decode launch each way in bf16 at Qwen3's head shapes, which "
        "of the stored key and the output differ and by how much (lab.checks.fused_rope_bits; ~40 s)",
        carry=(),
        steps=(ROPE_BITS,)),
    "fold": Call(
        "optional: issue 29, the RMSNorms folded into the decode GEMVs (kernel option gemv_norm_fold): tokens off "
        "and on (greedy and seeded sampling, batch 1 and 8, graphs and eager), then W2 off and on, two rounds; "
        "Qwen3-0.6B",
        carry=(),
        budget_s=400,  # what a session's last device minutes may allow
        steps=(Lab("fold06", 200, ("fold06.json",), ("fold06",)),)),
    "fold8": Call("optional: the same on Qwen3-8B, W2 in one round", carry=(), steps=(FOLD8,)),
    "early_meta": Call(
        "optional: issue 29, the decode kernels reading each request's length, row and slot, and RoPE each token's "
        "position and cos/sin, before their PDL wait (kernel option early_metadata): tokens off and on (greedy and "
        "seeded sampling, batch 1 and 8, graphs and eager), then W2 off and on, two rounds; Qwen3-0.6B",
        carry=(),
        steps=(Lab("early_meta06", 200, ("early_meta06.json",), ("early_meta06",)),)),
    "fused_rope": Call(
        "optional: issue 29, the next links of a batch-1 decode step: the RoPE and Qwen3's q/k norms inside the "
        "decode attention kernel (kernel option decode_fused_rope; one launch a layer fewer) and its first key tile "
        "read before the PDL wait (early_kv), each alone and both: tokens against both off (greedy and seeded "
        "sampling, batch 1 and 8, graphs and eager), then W2 in each arm, two rounds; Qwen3-0.6B",
        carry=(),
        # run24's early_meta06 (two arms, warm caches): 91 s
        steps=(Lab("fused_rope06", 260, ("fused_rope06.json",), ("fused_rope06",)),)),
    "links": Call("optional: fused_rope's arms both off and both on only (half its time), then the early keys off and "
                  "on on Qwen3.5-0.8B (tokens and W2, one round)", carry=(),
                  steps=(Lab("links06", 150, ("links06.json",), ("links06",)),
                         Lab("early_kv35", 120, ("early_kv35.json",), ("early_kv35",)))),
    "rope_tokens": Call("optional: the fused RoPE's tokens off and on alone (Qwen3-0.6B, graphs and eager), for a "
                        "lease's last minutes", carry=(),
                        steps=(ROPE_TOKENS,)),
    "fused_rope8": Call("optional: the same on Qwen3-8B, W2 in one round", carry=(),
                        steps=(Lab("fused_rope8", 480, ("fused_rope8.json",), ("fused_rope8",)),)),
    "fused_merge": Call(
        "optional: issue 29, the decode splits merged inside the first decode launch (kernel option "
        "decode_fused_merge; run10, before PDL's early loads, found it slower): tokens off and on, then W2 off and "
        "on, two rounds; Qwen3-0.6B",
        carry=(),
        steps=(Lab("fused_merge06", 120, ("fused_merge06.json",), ("fused_merge06",)),)),
    "mixes": Call(
        "optional, on a machine calls 1-4 staged: issue 29's Qwen3.5 mixes (512 requests of 16-2k prompts; 384 in 24 "
        "shared-prefix groups, mixed sampling), minisgl with its rows sized from memory and at the old 256, then "
        "SGLang on the same requests",
        carry=(KIT,),
        steps=(Lab("minisgl_mixes35", 150, ("qwen35_mixes.json",), ("mixes35", "mixes35_rows256")),
               SGLang("sglang_mixes35", 130, ("sglang_mixes_35.json",), "qwen3.5-0.8b", ("mixes",)))),
    "checks": Call(
        "optional: issue 27, W1/W2 at the defaults and two engines with different kernel options in one process "
        "(lab.checks.engine_options); issue 26, the API features' cost: json_object at batch 1, top-5 logprobs "
        "and penalties on W1 (lab.checks.h200_api_check; its structured-output arms need .sglang-whl/api: "
        "`python -m lab.lease api-wheels`); issue 29, where Qwen3.5's time goes on the 512-request mix and the "
        "chunk prepare's two solves there",
        carry=(API_WHEELS,),
        steps=(Lab("options", 100, ("engine_options.json",), ("options_check",)),  # run17: 95 s, 177 s, 103 s
               ApiCheck("api", 180, ("api_check.json",)),
               Lab("mix_phases35", 100, ("qwen35_mix_phases.json",), ("mix_phases35",)),
               Lab("gdn_solve35", 100, ("qwen35_gdn_solve.json",), ("gdn_solve35",)))),
    "serving_ours": Call(
        "optional: minisgl's server under minisgl's own client (minisgl.bench.serving: the same loads, the "
        "server's CPU seconds), then the same all-at-once requests offline (the server/offline ratio; notebook "
        "11 plots ours_*.json)",
        carry=(KIT, f"{WHEEL_DIR}/serve"),
        steps=(OwnClient("serving_ours", 300, ("ours_default.json",)),)),
}


# --- on the device -------------------------------------------------------------------------------------------


def missing_parts() -> list[str] | None:
    """The wheel parts not yet staged on this machine; None when none was (no manifest)."""
    manifest = WHEELS / MANIFEST
    if not manifest.is_file():
        return None
    parts = json.loads(manifest.read_text())
    return [part for part, names in parts.items() if not all((WHEELS / n).is_file() for n in names)]


def wheels_missing() -> str:
    missing = missing_parts()
    if missing is None:
        return f"no SGLang wheels on this machine ({WHEELS} is empty: a fresh machine, or no part carried yet)"
    return (f"SGLang's wheel part {'/'.join(missing) or '(none)'} is not on this machine: carry "
            f"{', '.join(f'{WHEEL_DIR}/{h}' for h in missing)} in a call on it")


def carried_parts(root: Path = REPO) -> list[str]:
    """The wheel parts in this tree (on the device: the ones this call carried, or an earlier call left)."""
    folder = root / WHEEL_DIR
    return sorted(d.name for d in folder.iterdir() if (d / MANIFEST).is_file()) if folder.is_dir() else []


def join_chunks(folder: Path) -> list[str]:
    """The wheels split_wheels sent in pieces, joined again in `folder`; their names. The pieces stay (the
    manifest names them: missing_parts reads it), and the kit unpacks only *.whl and *.tar.gz."""
    groups: dict[str, list[tuple[int, Path]]] = {}
    for f in folder.iterdir():
        m = CHUNK.match(f.name)
        if m:
            groups.setdefault(m.group(1), []).append((int(m.group(2)), f))
    for name, chunks in groups.items():
        with open(folder / name, "wb") as out:
            for _, f in sorted(chunks):
                out.write(f.read_bytes())
    return sorted(groups)


def stage_wheels(part: str) -> str:
    """Copy the carried part into WHEELS; once every part of the manifest is there, unpack them with the kit."""
    src = REPO / WHEEL_DIR / part
    if not src.is_dir():
        return f"{WHEEL_DIR}/{part} is not carried: SGLang steps will wait for it"
    WHEELS.mkdir(parents=True, exist_ok=True)
    for f in src.iterdir():
        if not (WHEELS / f.name).exists():
            shutil.copy2(f, WHEELS / f.name)
    if (SITE / ".sglang-kit").is_file():
        return "SGLang's wheels were already unpacked on this machine"
    if missing_parts() != []:
        return f"staged part {part}; {wheels_missing()}"
    join_chunks(WHEELS)
    rc = subprocess.run(["bash", str(REPO / KIT / "run_sglang.sh"), str(WHEELS), "--", "--help"],
                        stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT).returncode
    return f"staged part {part}; unpacked every wheel into {SITE} (kit's run_sglang.sh, rc {rc})"


def run_step(step: Step, out: str, remaining: float) -> str:
    step.prepare()
    why = step.ready()
    if why:
        return f"SKIPPED {step.name}: {why}"
    if step.seconds > remaining:
        return f"SKIPPED {step.name}: needs ~{step.seconds} s, {remaining:.0f} s left in this call's budget"
    log = LOGS / f"{step.name}.log"
    t0 = time.perf_counter()
    with open(log, "w") as f:
        proc = subprocess.Popen(step.argv(out), cwd=REPO, env={**os.environ, **step.env()}, stdout=f,
                                stderr=subprocess.STDOUT, start_new_session=True)
        try:
            rc = proc.wait(timeout=remaining)
        except subprocess.TimeoutExpired:
            stop_group(proc, grace_s=STOP_GRACE_S)  # the step's own process group: its children too
            rc = "stopped at the call's budget"
    tail = log.read_text(errors="replace").strip().splitlines()[-2:]
    return f"{step.name}: rc {rc}, {time.perf_counter() - t0:.0f} s (estimate {step.seconds}) | " + " | ".join(
        line[:240] for line in tail)


def label_commit(commit: str | None) -> None:
    """The device's copy of the tree has no .git (or not the current one): what this process and its children
    measure says which commit it is, from --commit."""
    if commit:
        os.environ["MINISGL_GIT_COMMIT"], os.environ["MINISGL_GIT_DIRTY"] = commit, "0"
    elif not (REPO / ".git").exists():
        raise SystemExit("no .git here: pass --commit SHA (python -m lab.lease plan prints it)")


def written_since(member: tarfile.TarInfo, started: float) -> tarfile.TarInfo | None:
    """Pack only what this call wrote: /tmp/lease-logs outlives a call on a warm machine, and run24's early_meta
    logs carried the tiles call's 30 MB of request logs again."""
    return member if member.isdir() or member.mtime >= int(started) else None


def run_call(name: str, out: str, commit: str | None, only: set[str] | None = None) -> None:
    call = CALLS[name]
    t_start, started = time.perf_counter(), time.time()
    LOGS.mkdir(parents=True, exist_ok=True)
    os.makedirs(out, exist_ok=True)
    label_commit(commit)
    print(f"{name}: {call.about}", flush=True)
    from minisgl.bench.host import host_probe_ms
    print(f"host probe {host_probe_ms()} ms (run17: a slow host made batch-1 figures incomparable; compare with "
          "the last lease's environment.host_probe_ms)", flush=True)
    try:
        for part in carried_parts():
            print(stage_wheels(part), flush=True)
        for step in call.steps:
            if only and step.name not in only:
                continue
            remaining = call.budget_s - (time.perf_counter() - t_start)
            print(f"[{time.strftime('%H:%M:%S')}] " + run_step(step, out, remaining), flush=True)
    finally:
        with tarfile.open(os.path.join(out, f"logs_{name}.tar.xz"), "w:xz") as tar:
            tar.add(LOGS, arcname="lease-logs", filter=lambda member: written_since(member, started))
        print(f"{name}: {time.perf_counter() - t_start:.0f} s", flush=True)


# The serving call (issue 24): both servers on one model folder (the kit's serving.sh writes it: Qwen3-0.6B body,
# the embedded model's 4k tokenizer, dummy weights), SGLang's bench_serving client against each, the same loads.
# SERVERS is the one place to change when minisgl's server gains flags; a name with flags after the base server's
# command is an A/B of a serve flag.
SERVE_MODEL = "/tmp/serving-model"
SERVE_SITE = Path("/tmp/site-serve")  # the kit's serving.sh unpacks the `serve` half there (its stamp: .done)
MINISGL_SERVE = [sys.executable, "-m", "minisgl", "serve", "--model", SERVE_MODEL, "--load-format", "dummy",
                 "--host", "127.0.0.1", "--port", "{port}", "--request-log", "{requests}", "--step-log", "{steps}"]
SERVERS = {
    "minisgl": MINISGL_SERVE,
    # the defaults before run25: a burst's mixed steps (8k prompt tokens beside hundreds of decode rows) eager, past
    # the largest prefill graph (run23: 20-45 ms of launches a step), the extend kernel on its grid
    "minisgl_eager_mixed": [*MINISGL_SERVE, "--disable-extend-tiles", "--prefill-graph-max-tokens", "4096",
                            "--prefill-graph-max-reqs", "64"],
    "sglang": ["bash", f"{KIT}/serving.sh", WHEEL_DIR, "sglang-server", "--", "--model-path", SERVE_MODEL,
               "--load-format", "dummy", "--dtype", "bfloat16", "--attention-backend", "triton",
               "--sampling-backend", "pytorch", "--grammar-backend", "none", "--host", "127.0.0.1", "--port", "{port}"],
}


def unpack_serve_part() -> None:
    """The `serve` part's wheels, where carried, unzipped into SERVE_SITE (once: the kit's serving.sh stamp)."""
    if (REPO / WHEEL_DIR / "serve").is_dir():
        unzip_wheels(REPO / WHEEL_DIR / "serve", SERVE_SITE)


def http_site_missing() -> str | None:
    """Why minisgl's server cannot start on this machine (its FastAPI and uvicorn come from SGLang's unpacked
    wheels and the `serve` part), or None."""
    if not (SITE / ".sglang-kit").is_file():
        return wheels_missing()
    if not (SERVE_SITE / ".done").is_file():
        return f"{WHEEL_DIR}/serve is not carried or not unpacked (minisgl's server takes its HTTP packages from it)"
    return None


def server_env(server: str) -> dict[str, str]:
    """The device's python has no fastapi/uvicorn: minisgl's server takes them from SGLang's unpacked wheels and
    the serve half (SGLang's command sets its own path in serving.sh)."""
    if not server.startswith("minisgl"):
        return {}
    return {"PYTHONPATH": os.pathsep.join([str(SITE), str(SERVE_SITE), str(REPO)])}


# name: (request rate, requests, output tokens, range ratio); 1,024 input tokens each (random ids, seed 1)
LOADS = {"rate8": ("8", 300, 256, 0.5), "rate24": ("24", 300, 256, 0.5), "rate48": ("48", 300, 256, 0.5),
         "burst": ("inf", 512, 512, 0.25)}


def write_serve_model() -> None:
    """The serving model folder, once per machine (the kit's serving.sh: no wheels needed for it)."""
    if not (Path(SERVE_MODEL) / "config.json").is_file():
        subprocess.run(["bash", f"{KIT}/serving.sh", WHEEL_DIR, "model", SERVE_MODEL], cwd=REPO, check=False)


def wait_healthy(proc: subprocess.Popen, port: int, limit_s: float = 300) -> float | None:
    import urllib.request
    t0 = time.perf_counter()
    while proc.poll() is None and time.perf_counter() - t0 < limit_s:
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2) as r:
                if r.status == 200:
                    return time.perf_counter() - t0
        except OSError:
            time.sleep(0.5)
    return None


def port_answers(port: int) -> bool:
    """Something already listens there (a server a stopped step left behind would answer a new one's /health)."""
    import socket
    with socket.socket() as s:
        return s.connect_ex(("127.0.0.1", port)) == 0


def stop_group(proc: subprocess.Popen, grace_s: float) -> None:
    """SIGTERM to the process's group, SIGKILL after grace_s: a server and its workers, or a step and its children."""
    try:
        os.killpg(proc.pid, signal.SIGTERM)
        proc.wait(timeout=grace_s)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
    except ProcessLookupError:
        pass


def client_env() -> dict[str, str]:
    """SGLang's client (lab.serve_client) under the kit's wheels and the serve half, as serving.sh runs it."""
    env = kit_env()
    return {**env, "PYTHONPATH": os.pathsep.join([str(SITE), str(SERVE_SITE), str(REPO / KIT / "sgstub"),
                                                  str(REPO)])}


def client_argv(port: int, load: str, jsonl: str) -> list[str]:
    """bench_serving's arguments for one load (the kit's serving.sh recipe)."""
    rate, prompts, out_len, ratio = LOADS[load]
    return ["--backend", "vllm", "--base-url", f"http://127.0.0.1:{port}", "--model", SERVE_MODEL,
            "--tokenizer", SERVE_MODEL, "--dataset-name", "random-ids", "--random-input-len", "1024",
            "--random-output-len", str(out_len), "--random-range-ratio", str(ratio), "--num-prompts", str(prompts),
            "--request-rate", rate, "--seed", "1", "--output-file", jsonl]


OFFLINE_LOAD = "burst"  # the load whose requests the offline engine runs too (the server/offline ratio)


def serve_bench(out: str, loads: list[str], servers: list[str] = ("minisgl", "sglang"),
                name: str = "serving") -> None:
    """Each server in turn: start it in its own process group, wait for /health, run SGLang's client at every load
    (lab.serve_client: one process, one JSON line a load in $OUT/<name>_<server>.jsonl), stop the group. Then,
    when minisgl's server ran the all-at-once load, the same requests through the offline engine (`LLM`), for the
    server's share of its token rate. $OUT/<name>.json (commands, start-up times, return codes, each load's client
    figures, the offline run) is written again after each part, so a step stopped at its call's budget keeps what
    it measured; the server is stopped on SIGTERM too (main() turns it into SystemExit), so no server outlives
    its step and answers the next step's client on the same port."""
    write_serve_model()
    # the kit's `serve` wheels, as its serving.sh unpacks them on first use (the same stamp): minisgl's server
    # takes fastapi/uvicorn from them, SGLang's client its aiohttp
    unpack_serve_part()
    from minisgl.bench.runner import environment
    env = {**environment(), "time_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}  # the call's start
    # uvicorn's HTTP parser in both servers: httptools when the serve part brought it (serve_wheels), else h11
    parser = "httptools" if (SERVE_SITE / "httptools").is_dir() or (SITE / "httptools").is_dir() else "h11"
    summary: dict = {"loads": {k: LOADS[k] for k in loads}, "http_parser": parser, "servers": {}}
    kept = os.path.join(LOGS, f"{name}_{OFFLINE_LOAD}_requests.json")
    for port, server in enumerate(servers, start=30001):
        requests_log = LOGS / f"requests_{server}.jsonl"  # minisgl's --request-log (engine_side reads it)
        steps_log = LOGS / f"steps_{server}.jsonl"  # and its --step-log (step_side)
        requests_log.unlink(missing_ok=True)
        steps_log.unlink(missing_ok=True)
        argv = [a.format(port=port, requests=requests_log, steps=steps_log) for a in SERVERS[server]]
        jsonl = os.path.join(out, f"{name}_{server}.jsonl")
        if port_answers(port):
            summary["servers"][server] = {"command": argv, "ready_s": None, "runs": [], "results": {},
                                          "error": f"port {port} already answers before the server starts: "
                                                   "another process would be measured; not run"}
            write_serving_summary(out, name, loads, servers, env, summary)
            continue
        log = open(LOGS / f"server_{server}.log", "w")
        proc = subprocess.Popen(argv, cwd=REPO, env={**os.environ, **server_env(server)}, stdout=log,
                                stderr=subprocess.STDOUT, start_new_session=True)
        summary["servers"][server] = {"command": argv, "ready_s": None, "runs": []}
        try:
            ready = summary["servers"][server]["ready_s"] = wait_healthy(proc, port)
            if ready is not None:
                summary["servers"][server]["runs"] = run_client(port, loads, jsonl, server, kept)
            else:  # why, in the summary: its exit code (None: still up, never healthy) and the end of its log
                log.flush()
                tail = (LOGS / f"server_{server}.log").read_text(errors="replace").strip().splitlines()[-5:]
                summary["servers"][server]["error"] = f"never healthy on port {port}: exit code {proc.poll()}; " \
                                                      + " | ".join(tail)
        finally:
            stop_group(proc, grace_s=SERVER_GRACE_S)
            log.close()
            summary["servers"][server]["results"] = serving_results(jsonl, loads)
            if requests_log.is_file():
                summary["servers"][server]["engine_side"] = engine_side(requests_log, LOGS / f"client_{server}",
                                                                        loads)
            if steps_log.is_file():
                summary["servers"][server]["step_side"] = step_side(steps_log, LOGS / f"client_{server}", loads)
            summary["servers"][server]["client_side"] = client_side(LOGS / f"client_{server}", loads)
            write_serving_summary(out, name, loads, servers, env, summary)
        print(server, summary["servers"][server], flush=True)
    ours = summary["servers"].get("minisgl", {}).get("results", {}).get(OFFLINE_LOAD)
    if ours and os.path.isfile(kept):
        summary["offline"] = offline_same_requests(kept)
        summary["server_over_offline"] = ours["output_throughput"] / summary["offline"]["output_tok_s"]
        write_serving_summary(out, name, loads, servers, env, summary)
        print("offline", summary["offline"], "server/offline", round(summary["server_over_offline"], 3), flush=True)


def client_runs(details: Path, loads: list[str]):
    """(load, the client's details of its run) for each load that ran (lab.serve_client's DETAILS_<load>.json with
    its run window)."""
    for load in loads:
        path = Path(f"{details}_{load}.json")
        if path.is_file():
            run = json.loads(path.read_text())
            if run.get("started") is not None:
                yield load, run


def engine_side(requests_log: Path, details: Path, loads: list[str]) -> dict:
    """{load: where its requests' time went}, from minisgl's --request-log (one line per request: when it reached
    the engine, its first token) and the client's run window (lab.serve_client's details: `started`, `ended`,
    on the same clock). A request belongs to the load whose run window holds its arrival. `arrival_ms`: from the
    run's start to the request reaching the engine (the client's send, the front's intake); `engine_ttft_ms`:
    from there to its first token (the engine's queue and prefill); by arrival eighths, the engine's part as the
    burst goes on (the client's TTFT minus it is the front's part, both ways)."""
    lines = [json.loads(line) for line in requests_log.read_text().splitlines() if line.strip()]
    out = {}
    for load, run in client_runs(details, loads):
        reqs = sorted((r for r in lines if run["started"] <= r["arrival"] <= run["ended"]
                       and r["first_token"] is not None), key=lambda r: r["arrival"])
        if not reqs:
            continue
        arrival = [1e3 * (r["arrival"] - run["started"]) for r in reqs]
        ttft = [1e3 * (r["first_token"] - r["arrival"]) for r in reqs]
        eighths = [ttft[i * len(ttft) // 8:(i + 1) * len(ttft) // 8] for i in range(8)]
        out[load] = {"requests": len(reqs), "arrival_ms_median": statistics.median(arrival),
                     "arrival_ms_max": max(arrival), "engine_ttft_ms_median": statistics.median(ttft),
                     "engine_ttft_ms_p99": sorted(ttft)[min(len(ttft) - 1, int(0.99 * len(ttft)))],
                     "engine_ttft_ms_median_by_arrival_eighth": [statistics.median(e) if e else None
                                                                 for e in eighths],
                     "from_first_send_ms": from_first_send(reqs, first_send(run)),
                     **long_gaps(reqs)}
    return out


def step_side(steps_log: Path, details: Path, loads: list[str]) -> dict:
    """{load: the engine's steps in the client's run window}, from minisgl's --step-log: how the steps ran (CUDA
    graph or eager), how long a loop turn took (until the next turn) in steps that prefilled and in those that only
    decoded, and the prompt tokens a second through the prefill phase (its first prompt step to its last one's
    end): a burst's engine time, step by step."""
    steps = [json.loads(line) for line in steps_log.read_text().splitlines() if line.strip()]
    out = {}
    for load, run in client_runs(details, loads):
        window = [s for s in steps if run["started"] <= s["t"] <= run["ended"]]
        turns = [(s, 1e3 * (b["t"] - s["t"])) for s, b in zip(window, window[1:]) if "reqs" in s]
        if not turns:
            continue
        prompt = [(s, ms) for s, ms in turns if s["prompt_tokens"]]
        decode = [ms for s, ms in turns if not s["prompt_tokens"]]
        kinds = dict(collections.Counter(s["kind"] for s, _ in turns))
        phase_s = (prompt[-1][0]["t"] + prompt[-1][1] / 1e3 - prompt[0][0]["t"]) if prompt else 0.0
        median = lambda xs: statistics.median(xs) if xs else None  # noqa: E731
        out[load] = {"steps": len(turns), "kinds": kinds, "prompt_steps": len(prompt),
                     "prompt_turn_ms_median": median([ms for _, ms in prompt]),
                     "prompt_step_decode_rows_median": median([s["decode_rows"] for s, _ in prompt]),
                     "prompt_step_tokens_median": median([s["prompt_tokens"] for s, _ in prompt]),
                     "prompt_kinds": {k: sum(1 for s, _ in prompt if s["kind"] == k) for k in kinds},
                     "prompt_tok_s": sum(s["prompt_tokens"] for s, _ in prompt) / phase_s if phase_s else None,
                     "decode_turn_ms_median": median(decode),
                     "host_ms_median": median([s["drain_ms"] + s["news_ms"] for s, _ in turns]),
                     "step_call_ms_median": median([s["step_ms"] for s, _ in turns])}
    return out


def from_first_send(reqs: list[dict], t0: float | None) -> dict | None:
    """When the measured requests reached the front's handlers (`received`, where the request log has it) and the
    engine, and got their first token, in ms from `t0`, client_side's origin (None without the client's starts)."""
    reqs = [r for r in reqs if t0 is not None and r["arrival"] >= t0]
    if not reqs:
        return None
    ms = lambda t: 1e3 * (t - t0)  # noqa: E731
    received = sorted(r["received"] for r in reqs if r.get("received") is not None)  # the front's handlers began
    return {**({"received_first": ms(received[0]), "received_median": ms(statistics.median(received)),
                "received_max": ms(received[-1])} if received else {}),
            "arrival_first": ms(reqs[0]["arrival"]),
            "arrival_median": ms(statistics.median(r["arrival"] for r in reqs)), "arrival_max": ms(reqs[-1]["arrival"]),
            "first_token_median": ms(statistics.median(r["first_token"] for r in reqs))}


def first_send(details: dict) -> float | None:
    """When the run's first measured request started its clock (the client's `starts`, the warm-up's dropped)."""
    starts = details.get("starts") or []
    return min(t for t, _ in starts[1:]) if len(starts) > 1 else None


def client_side(details: Path, loads: list[str]) -> dict:
    """{load: the client's own timeline}, from lab.serve_client's details (any server): in ms from the first
    measured request's start, when the requests started their clocks (a burst's tasks start one after another
    on the client's one event loop) and when their first tokens reached it. Beside minisgl's engine_side (the same
    origin): the client's share, the front's intake, the engine, the way back."""
    out = {}
    for load, run in client_runs(details, loads):
        t0 = first_send(run)
        if t0 is None:
            continue
        starts = [t for t, _ in run["starts"][1:]]
        firsts = sorted(1e3 * (t + ttft - t0) for t, ttft in run["starts"][1:] if ttft)
        out[load] = {"requests": len(starts), "sends_ms_median": 1e3 * (statistics.median(starts) - t0),
                     "sends_ms_max": 1e3 * (max(starts) - t0),
                     "first_token_ms_median": statistics.median(firsts) if firsts else None,
                     "first_token_ms_max": firsts[-1] if firsts else None}
    return out


def long_gaps(reqs: list[dict]) -> dict:
    """The engine's side of the client's P99 token gap, from the request log's long gaps (over its LONG_GAP_S):
    the P99 of all gaps when 1% of them are long (None: the P99 is shorter than LONG_GAP_S), and how many long
    gaps had a request reach the engine while they lasted (a prompt's prefill in those steps)."""
    gaps = [g for r in reqs for g in r.get("long_gaps", [])]
    total = sum(r.get("gaps", 0) for r in reqs)
    ranked = sorted((1e3 * g for _, g in gaps), reverse=True)
    k = int(0.01 * total)  # the gaps above the P99
    arrivals = sorted(r["arrival"] for r in reqs)
    overlapped = sum(bisect.bisect_left(arrivals, end) > bisect.bisect_right(arrivals, end - g) for end, g in gaps)
    return {"engine_itl_ms_p99": ranked[k] if k < len(ranked) else None, "long_gaps": len(gaps),
            "long_gaps_with_an_arrival": overlapped, "long_gap_ms_max": ranked[0] if ranked else None}


def run_client(port: int, loads: list[str], jsonl: str, server: str, kept: str) -> list[dict]:
    """SGLang's client at each load against the server on `port` (one process); each load's return code. The
    requests of OFFLINE_LOAD are kept (into `kept`) from minisgl's run."""
    runs_file, status_file = LOGS / f"client_{server}_runs.json", LOGS / f"client_{server}_status.json"
    runs_file.write_text(json.dumps([{"load": load, "argv": client_argv(port, load, jsonl)} for load in loads]))
    status_file.unlink(missing_ok=True)
    argv = [sys.executable, "-m", "lab.serve_client", "--runs", str(runs_file), "--status", str(status_file),
            "--details", str(LOGS / f"client_{server}")]  # request-by-request TTFTs, into the call's logs
    if server == "minisgl":
        argv += ["--keep", OFFLINE_LOAD, "--keep-out", kept]
    with open(LOGS / f"client_{server}.log", "w") as log:
        proc = subprocess.Popen(argv, cwd=REPO, env={**os.environ, **client_env()}, stdout=log,
                                stderr=subprocess.STDOUT, start_new_session=True)
        try:
            proc.wait()
        finally:
            stop_group(proc, grace_s=SERVER_GRACE_S)
    return json.loads(status_file.read_text()) if status_file.is_file() else []


def offline_same_requests(kept: str) -> dict:
    """The requests minisgl's server got at OFFLINE_LOAD, through `minisgl.LLM` on the serving model (greedy, each
    to its length, as the client asks); its output tokens per second."""
    from minisgl.bench.serving import run_offline
    reqs = [(r["prompt"], r["output_len"]) for r in json.loads(Path(kept).read_text())]
    return run_offline(SERVE_MODEL, ["--load-format", "dummy"], reqs)


def write_serving_summary(out: str, name: str, loads: list[str], servers: list[str], env: dict,
                          summary: dict) -> None:
    with open(os.path.join(out, f"{name}.json"), "w") as f:
        json.dump({"environment": env, "command": f"python -m lab.lease serve-bench --loads {','.join(loads)} "
                   f"--servers {','.join(servers)} --name {name}", "sections": {name: {"result": summary}}}, f,
                  indent=1)


def rebuild_serving_summary(out: str, loads: list[str], servers: list[str], name: str, environment_from: str,
                            time_utc: str) -> None:
    """The summary of a serve-bench that was stopped before it wrote it (run16's, before the summary was written
    after each server): each server's client figures from the JSONL lines the client wrote, the machine's
    environment from another file written on the same machine at the same commit, the time the step started."""
    env = {**json.loads(Path(environment_from).read_text())["environment"], "time_utc": time_utc,
           "rebuilt": f"from the client's JSONL lines by `python -m lab.lease serve-summary` (the step was stopped "
                      f"before it wrote this file); environment from {Path(environment_from).name}"}
    summary = {"loads": {k: LOADS[k] for k in loads},
               "servers": {s: {"results": serving_results(os.path.join(out, f"{name}_{s}.jsonl"), loads)}
                           for s in servers}}
    write_serving_summary(out, name, loads, servers, env, summary)


# what the report keeps of a bench_serving line (SGLang's client writes one per run)
SERVING_KEYS = ("completed", "duration", "request_throughput", "output_throughput", "concurrency",
                "median_ttft_ms", "p99_ttft_ms", "median_tpot_ms", "p99_tpot_ms", "median_itl_ms", "p99_itl_ms",
                "median_e2e_latency_ms", "p99_e2e_latency_ms")


def serving_results(jsonl: str, loads: list[str]) -> dict:
    """{load: the client's figures} from a server's bench_serving lines, matched to LOADS by their request rate
    (each load has its own; a load whose run failed has no line, so the order cannot be trusted)."""
    lines = []
    if os.path.isfile(jsonl):
        for line in Path(jsonl).read_text().splitlines():
            try:
                lines.append(json.loads(line))
            except ValueError:
                continue
    out = {}
    for name in loads:
        match = [r for r in lines if float(r.get("request_rate", -1)) == float(LOADS[name][0])]
        if match:
            out[name] = {k: match[-1].get(k) for k in SERVING_KEYS}
    return out


# --- here, before the lease ------------------------------------------------------------------------------------


def tree_bytes(root: Path = REPO) -> int:
    """What every call carries besides its carry list: tracked files and untracked ones git does not ignore."""
    names = subprocess.run(["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"], cwd=root,
                           capture_output=True, text=True, check=True).stdout.split("\0")
    return sum((root / n).stat().st_size for n in names if n and (root / n).is_file())


def path_bytes(path: Path) -> int:
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file()) if path.is_dir() else 0


WHEEL_PARTS = ("a", "b", "c", "d")
# A wheel larger than this travels in pieces (`<name>.chunk<k>`), joined on the machine once every part is there
# (join_chunks): whole files, the largest 14.9 MiB, kept the parts at 16.3 MiB or more.
CHUNK_BYTES = 8 << 20
CHUNK = re.compile(r"(.+)\.chunk(\d+)$")


def split_wheels(folder: Path, parts: tuple[str, ...] = WHEEL_PARTS, root: Path = REPO,
                 chunk_bytes: int = CHUNK_BYTES) -> dict[str, list[str]]:
    """Copy the wheels at the top of `folder` (the kit's prepare_wheels.sh output) into folder/a, folder/b, ...,
    a file over `chunk_bytes` in pieces, largest first into the lightest part, and write the manifest (every
    part's names) into each part. Parts of an earlier split are removed first."""
    wheels = sorted((f for f in folder.iterdir() if f.is_file() and f.name != MANIFEST),
                    key=lambda f: -f.stat().st_size)
    if not wheels:
        raise SystemExit(f"no wheels at the top of {folder} (bash ../shared/sglang-kit/prepare_wheels.sh {folder})")
    pieces: list[tuple[Path, int, int, str]] = []  # (file, offset, bytes, name in its part)
    for f in wheels:
        size = f.stat().st_size
        if size <= chunk_bytes:
            pieces.append((f, 0, size, f.name))
        else:
            pieces += [(f, off, min(chunk_bytes, size - off), f"{f.name}.chunk{k}")
                       for k, off in enumerate(range(0, size, chunk_bytes))]
    pieces.sort(key=lambda piece: -piece[2])
    plan: dict[str, list[tuple[Path, int, int, str]]] = {h: [] for h in parts}
    for piece in pieces:
        lightest = min(parts, key=lambda h: sum(x[2] for x in plan[h]))
        plan[lightest].append(piece)
    manifest = {h: sorted(name for *_, name in ps) for h, ps in plan.items()}
    room = CARRY_LIMIT - tree_bytes(root) - path_bytes(root / KIT)
    for d in folder.iterdir():
        if d.is_dir() and (d / MANIFEST).is_file():
            shutil.rmtree(d)
    for h, ps in plan.items():
        d = folder / h
        d.mkdir()
        for f, off, size, name in ps:
            if name == f.name and f.stat().st_dev == d.stat().st_dev:
                os.link(f, d / name)  # no second copy of 25 MB on this disk
            else:
                with open(f, "rb") as src, open(d / name, "wb") as dst:
                    src.seek(off)
                    dst.write(src.read(size))
        (d / MANIFEST).write_text(json.dumps(manifest, indent=1))
        size = path_bytes(d)
        print(f"{d}: {len(ps)} files, {size / 2**20:.1f} MiB ({'fits' if size <= room else 'DOES NOT FIT'} beside "
              f"the tree: {room / 2**20:.1f} MiB of room)")
    return manifest


def git(*args: str) -> str:
    return subprocess.run(["git", *args], cwd=REPO, capture_output=True, text=True).stdout.strip()


def plan() -> int:
    """Print each call's `run` arguments and checks; exit 1 when something would not fit or the tree is dirty."""
    commit, dirty = git("rev-parse", "HEAD"), git("status", "--porcelain", "--untracked-files=no")
    problems = [f"the tree has uncommitted changes (a lease measures a commit):\n{dirty}"] if dirty else []
    base = tree_bytes()
    print(f"commit {commit}; the tree that travels: {base / 2**20:.1f} MiB of {CARRY_LIMIT >> 20} MiB\n")
    total = 0
    for name, call in CALLS.items():
        command = f"python3 -m lab.lease {name} --commit {commit}"
        carried = base + sum(path_bytes(REPO / c) for c in call.carry)
        files = sum(len(s.files) for s in call.steps) + 1
        minutes = call.seconds / 60
        total += call.seconds if name in HEADLINE_CALLS else 0
        print(f"## {name}: {call.about}\n"
              f"run(command={json.dumps(command)}, carry={json.dumps(list(call.carry))}, timeout_s=540)\n"
              f"  ~{minutes:.1f} min ({', '.join(f'{s.name} ~{s.seconds} s' for s in call.steps)}); carries "
              f"{carried / 2**20:.1f} MiB; brings back {files} files\n")
        if not any(c.startswith(f"{WHEEL_DIR}/") and c.endswith(tuple(carried_parts())) for c in call.carry):
            kit = 0 if KIT in call.carry else path_bytes(REPO / KIT)
            along = [p for p in carried_parts() if carried + kit + path_bytes(REPO / WHEEL_DIR / p) <= CARRY_LIMIT]
            if along:
                print(f"  room to carry one part along (with {KIT}), staged on the machine: {', '.join(along)}\n")
        missing = [c for c in call.carry if not (REPO / c).exists()]
        if missing:
            problems.append(f"{name}: {', '.join(missing)} not here (see the module docstring)")
        serve_part = REPO / WHEEL_DIR / "serve"
        if (f"{WHEEL_DIR}/serve" in call.carry and serve_part.is_dir()
                and not any(f.name.startswith(SERVE_EXTRA_PREFIXES) for f in serve_part.glob("*.whl"))):
            problems.append(f"{name}: {WHEEL_DIR}/serve lacks {', '.join(SERVE_EXTRA)} (python -m lab.lease "
                            "serve-wheels)")
        if carried > CARRY_LIMIT:
            problems.append(f"{name} carries {carried / 2**20:.1f} MiB, over {CARRY_LIMIT >> 20} MiB")
        if call.seconds > call.budget_s or files > 8 or len(command) > 2000 or len(call.carry) > 8:
            problems.append(f"{name}: over a limit (seconds {call.seconds}, files {files})")
    print(f"calls 1-4: ~{total / 60:.1f} min of commands, plus ~1.5 min for the machine's start; run them back to "
          "back (a machine idle for 30 s is given back, and call 4 needs the wheels calls 1-3 staged)")
    for p in problems:
        print("PROBLEM:", p)
    return 1 if problems else 0


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("what", choices=[*CALLS, "plan", "split-wheels", "serve-bench", "serve-summary", "api-wheels",
                                     "serve-wheels"])
    ap.add_argument("folder", nargs="?", default=WHEEL_DIR, help="split-wheels: the wheels' folder")
    ap.add_argument("--commit", help="the commit the device's tree is (it has no .git)")
    ap.add_argument("--out", default=os.environ.get("OUT"), help="where the JSON goes (default $OUT)")
    ap.add_argument("--steps", help="run only these steps of the call (comma-separated)")
    ap.add_argument("--loads", default=",".join(LOADS), help=f"serve-bench: of {', '.join(LOADS)}")
    ap.add_argument("--servers", default="minisgl,sglang", help=f"serve-bench: of {', '.join(SERVERS)}")
    ap.add_argument("--name", default="serving", help="serve-bench: the output files' prefix")
    ap.add_argument("--environment-from", help="serve-summary: a JSON file of the same machine and commit")
    ap.add_argument("--time-utc", help="serve-summary: when the serve-bench step started")
    a = ap.parse_args(argv)
    if a.what == "plan":
        return plan()
    if a.what == "split-wheels":
        split_wheels(REPO / a.folder)
        return 0
    if a.what == "api-wheels":
        print("\n".join(api_wheels()))
        return 0
    if a.what == "serve-wheels":
        print("\n".join(serve_wheels()))
        return 0
    if not a.out:
        ap.error("--out or $OUT is required")
    if a.what in ("serve-bench", "serve-summary"):
        unknown = set(a.servers.split(",")) - set(SERVERS)
        if unknown:
            ap.error(f"unknown servers {sorted(unknown)}")
    if a.what == "serve-summary":
        if not (a.environment_from and a.time_utc):
            ap.error("serve-summary needs --environment-from and --time-utc")
        rebuild_serving_summary(a.out, a.loads.split(","), a.servers.split(","), a.name, a.environment_from,
                                a.time_utc)
        return 0
    if a.what == "serve-bench":
        label_commit(a.commit)  # run alone (not as a call's step), it labels its results as a call does
        LOGS.mkdir(parents=True, exist_ok=True)
        signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # a stopped step: finally-blocks stop the server
        serve_bench(a.out, a.loads.split(","), a.servers.split(","), a.name)
        return 0
    run_call(a.what, a.out, a.commit, set(a.steps.split(",")) if a.steps else None)
    return 0


if __name__ == "__main__":
    sys.exit(main())
