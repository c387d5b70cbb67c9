"""What the CPU engines may use on this machine, found out safely and once.

A CPU can advertise an acceleration that faults when used: a Sapphire Rapids
VM lists ``amx_tile``/``amx_int8``, grants the tile permission, and the first
``ldtilecfg`` takes a general protection fault, so llama.cpp built for the
native CPU dies by a signal on its first generation (its AMX path is one of
its "extra buffer types"). No check in this process can catch that: the
process is gone.

So before llama.cpp runs a model, ``llama_choice`` asks a child process
(``python -m batch_inference.engines.cpu_probe``) to load that model with
llama.cpp's defaults and generate a token (or embed a word, for an embedding
model). A child that dies by a signal is asked again with the extra buffer
types off (``llama_model_params.use_extra_bufts = False``): weights in plain
buffers, no AMX and no repacking. The answer is cached per signature (the CPU's
model name and the flags that matter, llama-cpp-python's version and the
library file it loads, the model file) in ``cpu-probe.json`` under the user's
cache directory (``BATCH_INFERENCE_CPU_PROBE_CACHE`` names another file), so
only the first worker on a machine pays the probe (about a second for
SmolLM2); the others read it under the same file lock. Where nothing works the
engine refuses to load with one line naming the CPU and the cause.

``vllm_cpu_notes`` does the cheap part for vLLM's CPU build: bfloat16 without
``avx512_bf16`` (or AMX) is emulated and slow; with AMX advertised, a child
runs one bfloat16 matmul through torch (oneDNN) and, if it dies by a signal,
``ONEDNN_MAX_CPU_ISA`` keeps oneDNN off AMX in this process.

``BATCH_INFERENCE_CPU_PROBE_FAULT`` exists for tests on CPUs without the fault:
honoured only by the probe child, ``extra_bufts`` makes it die by SIGSEGV
when the extra buffer types are on (as the AMX path does), ``all`` always
(the oneDNN child too).
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import json
import logging
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

from batch_inference.exceptions import InvalidValue

log = logging.getLogger("batch_inference.engines.cpu_probe")

CACHE_ENV = "BATCH_INFERENCE_CPU_PROBE_CACHE"
FAULT_ENV = "BATCH_INFERENCE_CPU_PROBE_FAULT"
# The flags that decide which kernels llama.cpp and oneDNN pick on x86.
FLAGS_THAT_MATTER = ("avx", "avx2", "fma", "f16c", "avx_vnni", "avx512f", "avx512bw", "avx512vl", "avx512_vnni",
                     "avx512_bf16", "avx512_fp16", "amx_tile", "amx_int8", "amx_bf16")
PROBE_TIMEOUT_S = 300.0     # a model load on a loaded machine; a child past it counts as hung
_LOCK = threading.Lock()    # Llama() reads the default model parameters we replace for a while


@dataclasses.dataclass(frozen=True)
class Cpu:
    model: str
    flags: tuple[str, ...]      # those of FLAGS_THAT_MATTER it advertises

    def describe(self) -> str:
        """'AMD EPYC (avx2 avx512f avx512_bf16, no amx)'."""
        shown = [f for f in self.flags if f not in ("avx", "fma", "f16c", "avx512bw", "avx512vl")]
        amx = any(f.startswith("amx") for f in self.flags)
        return f"{self.model} ({' '.join(shown) or 'no avx'}{'' if amx else ', no amx'})"


def this_cpu(cpuinfo: str | None = None) -> Cpu:
    """This machine's CPU from /proc/cpuinfo (the platform's name where there is none)."""
    if cpuinfo is None:
        try:
            cpuinfo = Path("/proc/cpuinfo").read_text(errors="replace")
        except OSError:
            cpuinfo = ""
    model, flags = "", set()
    for line in cpuinfo.splitlines():
        key, _, value = line.partition(":")
        key = key.strip()
        if key == "model name" and not model:
            model = value.strip()
        elif key == "flags" and not flags:
            flags = set(value.split())
    if not model:
        import platform

        model = platform.processor() or platform.machine() or "unknown CPU"
    return Cpu(model, tuple(f for f in FLAGS_THAT_MATTER if f in flags))


@dataclasses.dataclass(frozen=True)
class Choice:
    """What llama.cpp uses here, and why (``line`` is what the engine logs)."""

    extra_bufts: bool
    reason: str
    cpu: str
    cached: bool = False
    probe_s: float = 0.0

    @property
    def line(self) -> str:
        what = "its defaults (extra buffer types on)" if self.extra_bufts else "no extra buffer types (no AMX, no repacking)"
        when = "cached probe" if self.cached else f"probe {self.probe_s:.1f} s"
        return f"llama.cpp on {self.cpu}: {what}: {self.reason} ({when})"


def cache_path() -> Path:
    env = os.environ.get(CACHE_ENV)
    if env:
        return Path(env)
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "batch-inference" / "cpu-probe.json"


def _file_id(path: Path) -> str:
    st = path.stat()
    return f"{path.resolve()}:{st.st_size}:{st.st_mtime_ns}"


def llama_build() -> str:
    """llama-cpp-python's version and the shared library it loads (path, size, time): a rebuild is a new build."""
    import llama_cpp

    here = Path(llama_cpp.__file__).parent
    libs = sorted({p.resolve() for p in (list(here.glob("lib/libllama*")) or list(here.glob("**/libllama*")))})
    return f"llama-cpp-python {llama_cpp.__version__} " + (" ".join(_file_id(p) for p in libs) or "no lib found")


def signature(cpu: Cpu, build: str, model: Path, mode: str) -> str:
    text = json.dumps({"cpu": cpu.model, "flags": cpu.flags, "build": build, "model": _file_id(model),
                       "mode": mode}, sort_keys=True)
    return hashlib.sha256(text.encode()).hexdigest()[:24]


@contextlib.contextmanager
def _locked_cache() -> Iterator[dict[str, Any]]:
    """The cache's entries, under an exclusive lock; written back (atomically) on exit."""
    import fcntl

    path = cache_path()
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        lock = open(path.with_name(path.name + ".lock"), "a")
    except OSError as exc:   # nowhere to keep it: this process probes for itself
        log.warning("CPU probe cache %s cannot be written (%s); probing without it", path, exc)
        yield {}
        return
    with lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            entries = json.loads(path.read_text()) if path.exists() else {}
            if not isinstance(entries, dict):
                entries = {}
        except (OSError, ValueError):
            entries = {}
        before = json.dumps(entries, sort_keys=True)
        yield entries
        if json.dumps(entries, sort_keys=True) != before:
            try:
                tmp = path.with_name(f"{path.name}.{os.getpid()}.tmp")
                tmp.write_text(json.dumps(entries, indent=1, sort_keys=True))
                os.replace(tmp, path)
            except OSError as exc:
                log.warning("CPU probe cache %s cannot be written (%s)", path, exc)


def died_how(code: int | None) -> str:
    """'SIGSEGV' for -11, 'exit 1', 'no answer (hung)' for None."""
    if code is None:
        return f"no answer in {PROBE_TIMEOUT_S:.0f} s (hung)"
    if code < 0:
        try:
            return signal.Signals(-code).name
        except ValueError:
            return f"signal {-code}"
    return f"exit {code}"


def _run_child(model: Path, extra_bufts: bool, embedding: bool) -> tuple[int | None, str]:
    """(exit code, last stderr line) of a probe child; None when it hung."""
    cmd = [sys.executable, "-m", "batch_inference.engines.cpu_probe", "llama", str(model),
           "--extra-bufts", "1" if extra_bufts else "0"] + (["--embedding"] if embedding else [])
    try:
        p = subprocess.run(cmd, capture_output=True, text=True, errors="replace", timeout=PROBE_TIMEOUT_S,
                           env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)})
    except subprocess.TimeoutExpired:
        return None, ""
    err = [ln for ln in p.stderr.splitlines() if ln.strip()]
    return p.returncode, err[-1][:300] if err else ""


def llama_choice(model: Path, *, embedding: bool = False, cpu: Cpu | None = None) -> Choice:
    """Whether llama.cpp may use its extra buffer types for ``model`` here, probed once per signature.

    InvalidValue (one line naming the CPU and the cause) where no setting generates."""
    cpu = cpu or this_cpu()
    mode = "embed" if embedding else "generate"
    key = signature(cpu, llama_build(), model, mode)
    with _locked_cache() as entries:
        hit = entries.get(key)
        if isinstance(hit, dict) and "extra_bufts" in hit:
            if hit["extra_bufts"] is None:
                raise InvalidValue(f"{hit['reason']} (probed at {time.strftime('%Y-%m-%d %H:%M', time.localtime(hit.get('at', 0)))}, "
                                   f"cached in {cache_path()}: delete it to probe again)")
            return Choice(bool(hit["extra_bufts"]), str(hit["reason"]), cpu.describe(), cached=True)
        t0 = time.monotonic()
        code, err = _run_child(model, True, embedding)
        if code == 0:
            choice = Choice(True, f"a child process loaded {model.name} and ran it with them", cpu.describe())
        elif code is not None and code > 0:
            # An error, not a fault (an unreadable model, say): not the CPU's; the engine's own load says what.
            log.warning("CPU probe of llama.cpp could not run (%s: %s); using llama.cpp's defaults", died_how(code),
                        err)
            return Choice(True, f"the probe could not run ({died_how(code)})", cpu.describe())
        else:
            first = died_how(code)
            code2, err2 = _run_child(model, False, embedding)
            if code2 != 0:
                reason = (f"llama.cpp cannot run {model.name} on this CPU, {cpu.describe()}: a probe child died by "
                          f"{first} with llama.cpp's defaults and by {died_how(code2)} without its extra buffer "
                          f"types{f' ({err2})' if err2 else ''}; {llama_build().split(' /')[0]}")
                entries[key] = {"extra_bufts": None, "reason": reason, "cpu": cpu.describe(), "at": time.time()}
                raise InvalidValue(reason)
            choice = Choice(False, f"with them a child process running {model.name} died by {first} (an "
                                   "advertised acceleration that faults here); without them it ran", cpu.describe())
        choice = dataclasses.replace(choice, probe_s=time.monotonic() - t0)
        entries[key] = {"extra_bufts": choice.extra_bufts, "reason": choice.reason, "cpu": choice.cpu,
                        "model": str(model), "mode": mode, "at": time.time()}
        return choice


def new_llama(kwargs: Mapping[str, Any], extra_bufts: bool) -> Any:
    """``llama_cpp.Llama(**kwargs)``, with llama.cpp's extra buffer types off unless ``extra_bufts``.

    llama-cpp-python 0.3.36 takes no argument for ``use_extra_bufts``: ``Llama()`` starts from
    ``llama_model_default_params()``, so that is answered with the field cleared while it loads."""
    import llama_cpp
    from llama_cpp import llama as llama_module

    if extra_bufts:
        return llama_cpp.Llama(**kwargs)
    low = llama_module.llama_cpp
    with _LOCK:
        default = low.llama_model_default_params

        def without_extra_bufts() -> Any:
            params = default()
            params.use_extra_bufts = False
            return params

        low.llama_model_default_params = without_extra_bufts
        try:
            return llama_cpp.Llama(**kwargs)
        finally:
            low.llama_model_default_params = default


def llama_for(kwargs: Mapping[str, Any], logger: logging.Logger | logging.LoggerAdapter | None = None) -> Any:
    """``Llama(**kwargs)`` as this CPU allows (``llama_choice``), the choice said once in ``logger``."""
    choice = llama_choice(Path(kwargs["model_path"]), embedding=bool(kwargs.get("embedding")))
    (logger or log).info("%s", choice.line)
    return new_llama(kwargs, choice.extra_bufts)


# -- vLLM's CPU build -----------------------------------------------------------

def bf16_native(cpu: Cpu) -> bool:
    return "avx512_bf16" in cpu.flags or "amx_bf16" in cpu.flags


def vllm_cpu_notes(dtype: str, cpu: Cpu | None = None) -> list[str]:
    """What this CPU means for vLLM's CPU build, in lines for the log; sets ``ONEDNN_MAX_CPU_ISA`` when
    oneDNN's AMX path faults here (probed in a child, once per signature, only where AMX is advertised)."""
    cpu = cpu or this_cpu()
    notes = []
    if dtype in ("bfloat16", "auto") and not bf16_native(cpu):
        notes.append(f"vLLM on {cpu.describe()}: no avx512_bf16 or amx_bf16, so bfloat16 is emulated (several "
                     "times slower than on a CPU with it); dtype float32 avoids the emulation but is a new job "
                     "version")
    if "amx_tile" in cpu.flags and "ONEDNN_MAX_CPU_ISA" not in os.environ:
        key = hashlib.sha256(json.dumps({"cpu": cpu.model, "flags": cpu.flags, "mode": "onednn-bf16",
                                         "py": sys.executable}).encode()).hexdigest()[:24]
        with _locked_cache() as entries:
            hit = entries.get(key)
            if not isinstance(hit, dict):
                cmd = [sys.executable, "-m", "batch_inference.engines.cpu_probe", "onednn"]
                try:
                    code: int | None = subprocess.run(cmd, capture_output=True, timeout=PROBE_TIMEOUT_S).returncode
                except subprocess.TimeoutExpired:
                    code = None
                hit = entries[key] = {"amx_ok": code == 0, "how": died_how(code), "at": time.time()}
        if not hit["amx_ok"]:
            os.environ["ONEDNN_MAX_CPU_ISA"] = "AVX512_CORE_BF16" if bf16_native(cpu) else "AVX2"
            notes.append(f"vLLM on {cpu.describe()}: a bfloat16 matmul through oneDNN died by {hit['how']} in a "
                         f"child process; ONEDNN_MAX_CPU_ISA={os.environ['ONEDNN_MAX_CPU_ISA']} keeps it off AMX")
        else:
            notes.append(f"vLLM on {cpu.describe()}: oneDNN's AMX path ran a bfloat16 matmul in a child process")
    if not notes:
        notes.append(f"vLLM on {cpu.describe()}: {'bfloat16 native' if bf16_native(cpu) else 'no bfloat16 asked'}, "
                     "no AMX advertised: oneDNN's defaults")
    return notes


# -- the probe child --------------------------------------------------------------

def _child(argv: list[str]) -> int:
    import argparse

    p = argparse.ArgumentParser(prog="python -m batch_inference.engines.cpu_probe")
    sub = p.add_subparsers(dest="what", required=True)
    lp = sub.add_parser("llama")
    lp.add_argument("model")
    lp.add_argument("--extra-bufts", type=int, choices=(0, 1), default=1)
    lp.add_argument("--embedding", action="store_true")
    sub.add_parser("onednn")
    args = p.parse_args(argv)
    fault = os.environ.get(FAULT_ENV, "")
    if args.what == "onednn":
        if fault == "all":
            os.kill(os.getpid(), signal.SIGSEGV)    # the test switch: as a faulting AMX tile load dies
        import torch

        a = torch.randn(64, 64).to(torch.bfloat16)
        print(float((a @ a).float().sum()))
        return 0
    kwargs: dict[str, Any] = {"model_path": args.model, "n_ctx": 256, "verbose": False}
    if args.embedding:
        kwargs["embedding"] = True
    llm = new_llama(kwargs, bool(args.extra_bufts))
    if fault == "all" or (fault == "extra_bufts" and args.extra_bufts):
        os.kill(os.getpid(), signal.SIGSEGV)    # the test switch: as the faulting path dies, at the first compute
    if args.embedding:
        llm.embed("probe")
    else:
        llm.create_completion("Hello", max_tokens=2, temperature=0)
    print("ok")
    return 0


if __name__ == "__main__":
    sys.exit(_child(sys.argv[1:]))
