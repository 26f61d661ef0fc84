"""Native CPU kernels (cpu_kernels.c) for the fp32 decode hot path, called through ctypes.

At batch 1 a CPU decode step is a string of tiny ops (norms, rope, cache writes, gating, attention)
whose dispatch cost rivals the weight reads; at large batches decode attention dominates what is
not a matmul, because the torch path must gather K/V through the block tables before SDPA.  These
kernels do each of those in one call and read K/V straight from the paged cache.

The C files (cpu_kernels.c, quant_kernels.c for GGUF block-quantized weights: gguf_quant.py,
fp8_kernels.c for FP8 block weights: fp8_quant.py, dsa_kernels.c for DSA's indexer: dsa.py, and
lora_kernels.c for LoRA adapters' grouped shrink/expand: lora/ops.py)
are compiled together, into one library, on first use with the system C compiler (`cc`, or $CC) into
$XDG_CACHE_HOME/roofline (default ~/.cache/roofline), one build per instruction set (ISA_BUILDS: the
best this CPU runs, or --cpu-isa's), keyed by the sources' hash and the build; that takes about a
second and happens once per machine and build.  Without a compiler (or with
--no-cpu-kernels) `available()` is False and every caller keeps its torch code, which stays
the reference the kernels are tested against.

Contracts (all tensors fp32 on CPU, unit stride in the last dim):
    rms_norm(x, w, eps, residual)          same as RMSNorm.forward
    silu_and_mul(x)                        same as SiluAndMul.forward
    gelu_tanh_and_mul(x)                   same as GeluTanhAndMul.forward (GeGLU)
    rotary_(q, k, cos, sin)                rotate-half rope of q [N,H,D], k [N,Hk,D] IN PLACE
    write_kv(k, v, kv_cache, slots)        same as attention.backend.write_kv_torch
    paged_decode_attention(q, kv_cache, block_tables, seq_lens, scale) -> [n, H, D]
    gemv(x, weight, bias)                  F.linear for one row over an [in x out]-major weight
    pack_panels(weight) -> panels          weight [out, in] (any strides) re-laid for gemm_packed
    gemm_packed(x, panels, out_features, bias)  F.linear over the packed weight, any number of rows
    llama_stack(...)                       every decoder layer of a step (models/llama_cpu_stack.py)
    greedy_head(...)                       argmax of the LM head's logits via an int8 screen (greedy_head.py)
    route_logits(h, ids, panels, dense, T)  chosen tokens' logits as the packed GEMM / the GEMV computes them
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import tempfile
import threading
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Optional

import torch

from roofline.config import CPU_ISAS, Switch, cache_dir, env_flag

logger = logging.getLogger(__name__)

SOURCE = Path(__file__).with_name("cpu_kernels.c")
# one library: the quantized linears (GGUF blocks, FP8 blocks) use the packed GEMM
SOURCES = (SOURCE, Path(__file__).with_name("quant_kernels.c"), Path(__file__).with_name("fp8_kernels.c"),
           Path(__file__).with_name("dsa_kernels.c"), Path(__file__).with_name("lora_kernels.c"))

SWITCH = Switch("cpu_kernels")
PANEL = 16  # output columns per packed panel (GEMM_NR in cpu_kernels.c); head sizes prefill takes
GREEDY_HQ_MAX = 32767  # greedy_head's int16 hidden states: |hq| <= this (a block's int32 sum: 32 x 32767 x 127)

_lock = threading.Lock()
_lib: Optional[ctypes.CDLL] = None
_tried = False

_P = ctypes.c_void_p
_I = ctypes.c_int64
_F = ctypes.c_float
_SIGNATURES = {
    "rms_norm_f32": [_P, _P, _P, _P, _P, _I, _I, _I, _F, ctypes.c_int],
    "rotary_f32": [_P, _I, _I, _P, _I, _I, _I, _I, _I, _P, _P, ctypes.c_int],
    "write_kv_f32": [_P, _I, _P, _I, _P, _P, _P, _I, _I],
    "silu_and_mul_f32": [_P, _P, _I, _I, ctypes.c_int],
    "gelu_tanh_and_mul_f32": [_P, _P, _I, _I, ctypes.c_int],
    "paged_decode_attention_f32": [_P, _I, _P, _P, _P, _P, _I, _P, _I, _I, _I, _I, _I, _F, ctypes.c_int],
    "paged_prefill_attention_f32": [_P, _I, _P, _P, _P, _P, _I, _P, _P, _I, _I, _I, _I, _I, _F, ctypes.c_int],
    "paged_decode_attention_opts_f32": [_P, _I, _P, _P, _P, _P, _I, _P, _I, _I, _I, _I, _I, _F, _I, _F, _P,
                                        ctypes.c_int],
    "paged_prefill_attention_opts_f32": [_P, _I, _P, _P, _P, _P, _I, _P, _P, _I, _I, _I, _I, _I, _F, _I, _F, _P,
                                         ctypes.c_int],
    "gemv_f32": [_P, _P, _P, _P, _I, _I, _I, ctypes.c_int],
    "argmax_rows_f32": [_P, _I, _I, _I, _P, ctypes.c_int],
    "pack_panels_f32": [_P, _I, _I, _I, _P],
    "gemm_packed_f32": [_P, _I, _P, _P, _P, _I, _I, _I, _I, ctypes.c_int],
    "gemm_packed_silu_mul_f32": [_P, _I, _P, _P, _I, _I, _I, _I, ctypes.c_int],
    "moe_experts_f32": [_P, _I, _I, _I, _P, _P, _P, _P, _I, _P, _P, _P, _P, ctypes.c_int, _F, _F, _I, _I, _P, _P,
                             _P, _P, _P, ctypes.c_int],
    "greedy_head_f32": [_P, _I, _I, _I, _I, _P, _P, _P, _P, _F, ctypes.c_int32, _P, _P, _I, _I, _P, _P, _P,
                        ctypes.c_int],
    "route_logits_f32": [_P, _I, _P, _I, _P, _P, _I, _I, _P],
    "llama_stack_fields": [],
    "llama_stack_lora_fields": [],
    "llama_stack_f32": [_P, _P, _I, _P, _I, _P, _F, _F, _P, _P, _P, _P, _I, _I, _P, _P, _P, _I, _P, _I,
                        _P, _I, _P, _I, _P, _I, ctypes.c_int],
}
_RESTYPES = {"llama_stack_fields": _I, "llama_stack_lora_fields": _I, "greedy_head_f32": _I,
             "llama_stack_f32": ctypes.c_int}  # the rest return nothing


def _cpu_flags() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                return line
    except OSError:
        pass
    return platform.processor()


# Builds of the kernels, best first: the compiler flags of each, and the CPU flags it needs.  The C code
# has AVX2+FMA+F16C paths (__AVX2__ ...) and plain C loops for everything else; the AVX-512 build adds
# hand-written sixteen-lane code and what the compiler makes of the wider registers, and needs VNNI
# (vpdpbusd: Ice Lake, Zen 4 and later; AVX-512 CPUs without it take the AVX2 build) -- only the functions
# that call it are compiled for it (quant_kernels.c X16_VNNI): GCC 12.2 turns signed byte dot products
# into vpdpbusd, which takes one side unsigned, wherever it may -- NEON is the base of every aarch64 CPU (the plain loops
# vectorized for it), portable runs anywhere.
BASE_FLAGS = ("-O3", "-fopenmp", "-ffp-contract=off", "-std=c11")  # every build's, before its ISA_BUILDS flags
ISA_BUILDS = {
    "avx512": (["-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512dq", "-mavx2", "-mfma", "-mf16c"],
               {"avx512f", "avx512bw", "avx512vl", "avx512dq", "avx512_vnni", "avx2", "fma", "f16c"}),
    "avx2": (["-mavx2", "-mfma", "-mf16c"], {"avx2", "fma", "f16c"}),
    "neon": (["-march=armv8-a"], set()),
    "portable": ([], set()),
}
assert set(CPU_ISAS) == {"auto", *ISA_BUILDS}, "config.CPU_ISAS names these builds"
_isa_request = "auto"
_isa_loaded: Optional[str] = None


def supported_isas() -> list[str]:
    """The builds this CPU runs, best first (portable always)."""
    machine = platform.machine().lower()
    flags = set(_cpu_flags().split())
    if machine in ("x86_64", "amd64", "i686", "i386"):
        out = [name for name in ("avx512", "avx2") if ISA_BUILDS[name][1] <= flags]
    elif machine in ("aarch64", "arm64"):
        out = ["neon"]
    else:
        out = []
    return out + ["portable"]


def select_isa(name: str) -> None:
    """--cpu-isa: which build to load (auto: the best supported_isas()); before the first kernel call,
    or the library is loaded again.  A build this CPU cannot run is a ValueError naming the field."""
    global _isa_request, _tried, _lib
    if name not in CPU_ISAS:
        raise ValueError(f"cpu_isa must be one of {', '.join(CPU_ISAS)}, got {name!r}")
    if name != "auto" and name not in supported_isas():
        raise ValueError(f"cpu_isa {name!r} does not run on this CPU (it runs: {', '.join(supported_isas())})")
    with _lock:
        if name != _isa_request:  # load the requested build at the next call (a build loaded before is
            _isa_request, _tried, _lib = name, False, None  # the same file: the loader hands it back)


def loaded_isa() -> Optional[str]:
    """The build in use (None until loaded, or when the kernels are unavailable)."""
    return _isa_loaded if _lib is not None else None


def _compile(sources: tuple[Path, ...], out: Path, isa: str) -> None:
    """Compile one build: each source to an object file, as many at once as this machine has cores (the
    sources are separate translation units either way: 8.8 s in one gcc call against 5.2 s for five
    objects on two cores), then link them.  The library appears at `out` atomically."""
    cc = env_flag("CC") or shutil.which("cc") or shutil.which("gcc") or shutil.which("clang")
    if cc is None:
        raise RuntimeError("no C compiler found (cc, gcc or clang; or set CC)")
    flags = [*BASE_FLAGS, "-fPIC", *ISA_BUILDS[isa][0]]
    out.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=out.parent) as work:
        objects = [os.path.join(work, f"{i}-{src.stem}.o") for i, src in enumerate(sources)]
        jobs = [[cc, *flags, "-c", str(src), "-o", obj] for src, obj in zip(sources, objects)]
        # the longest first, so that the others share the remaining cores beside it
        order = sorted(range(len(jobs)), key=lambda i: -sources[i].stat().st_size)
        with ThreadPoolExecutor(max_workers=max(1, os.cpu_count() or 1)) as pool:
            results = list(pool.map(lambda i: (i, subprocess.run(jobs[i], capture_output=True, text=True)), order))
        failures = [f"{sources[i].name}: {r.stderr.strip()[-500:]}" for i, r in results if r.returncode != 0]
        if failures:
            raise RuntimeError(f"compiling the {isa} build of the native CPU kernels failed: {'; '.join(failures)}")
        tmp = os.path.join(work, out.name)
        r = subprocess.run([cc, *flags, "-shared", *objects, "-o", tmp, "-lm"], capture_output=True, text=True)
        if r.returncode != 0:
            raise RuntimeError(f"linking the {isa} build of the native CPU kernels failed: {r.stderr.strip()[-500:]}")
        os.replace(tmp, out)  # atomic: concurrent processes never load a half-written file


def _candidates(isa: str) -> list[str]:
    """The builds to try for an --cpu-isa value, best first (auto: every build this CPU runs)."""
    return supported_isas() if isa == "auto" else [isa]


def _library_path(isa: str) -> Path:
    """Where the cache keeps one build (its key: the sources, the ISA's flags and the machine)."""
    source = b"".join(src.read_bytes() for src in SOURCES)
    flags = " ".join(ISA_BUILDS[isa][0]).encode()
    key = hashlib.sha256(source + isa.encode() + flags + platform.machine().encode()).hexdigest()[:16]
    return cache_dir() / f"cpu_kernels-{isa}-{key}.so"


_background: dict[str, Future] = {}  # ISA -> its build started by build_in_background
_background_lock = threading.Lock()


def build_in_background(isa: str = "auto") -> bool:
    """Start compiling the build `isa` names (auto: the best this CPU runs) on a thread of its own, when the
    cache lacks it: the engine calls this first thing on a CPU, so that a cold start compiles the kernels
    (gcc in subprocesses: the thread holds no GIL while it waits) while the model's config and tokenizer
    load, instead of after.  The first kernel call then waits for that build.  Returns whether a build
    started.  A build that fails is reported when the kernels load, as without this."""
    candidates = _candidates(isa)
    if not SWITCH.on() or not candidates or candidates[0] not in supported_isas():
        return False  # select_isa refuses a build this CPU cannot run: nothing to build for it
    target = candidates[0]
    with _background_lock:
        if target in _background or _library_path(target).exists():
            return False
        future: Future = Future()
        _background[target] = future

    def run() -> None:
        try:
            future.set_result(_build_now(target))
        except BaseException as e:  # handed to whoever loads the kernels
            future.set_exception(e)

    threading.Thread(target=run, name=f"roofline-kernels-{target}", daemon=True).start()
    return True


def _build(isa: str) -> Path:
    """The cached library of one build: the one build_in_background started (waited for), or compiled now."""
    with _background_lock:
        future = _background.pop(isa, None)
    if future is not None:
        return future.result()
    return _build_now(isa)


def _build_now(isa: str) -> Path:
    path = _library_path(isa)
    if not path.exists():
        _compile(SOURCES, path, isa)
    return path


def _load() -> Optional[ctypes.CDLL]:
    global _lib, _tried, _isa_loaded
    with _lock:
        if _tried:
            return _lib
        _tried = True
        try:
            errors = []
            for isa in _candidates(_isa_request):  # the best build that compiles
                try:
                    path = _build(isa)
                    break
                except RuntimeError as e:
                    errors.append(str(e))
            else:
                raise RuntimeError(" | ".join(errors))
            torch.get_num_threads()  # torch (and its libgomp) is loaded first: one OpenMP runtime
            lib = ctypes.CDLL(str(path))
            for name, argtypes in _SIGNATURES.items():
                fn = getattr(lib, name)
                fn.argtypes, fn.restype = argtypes, _RESTYPES.get(name)
            _lib, _isa_loaded = lib, isa
            logger.info("native CPU kernels: the %s build", isa)
        except Exception as e:  # no compiler, read-only cache, ...: the torch code runs instead
            logger.warning("native CPU kernels unavailable, using torch ops (%s)", e)
            _lib = None
        return _lib


def declare(name: str, argtypes: list, restype=None) -> None:
    """Register the ctypes signature of a kernel another module wraps (gguf_quant.py): applied when the
    library loads, or at once when it is loaded already."""
    _SIGNATURES[name] = argtypes
    if restype is not None:
        _RESTYPES[name] = restype
    with _lock:
        if _lib is not None:
            fn = getattr(_lib, name)
            fn.argtypes, fn.restype = argtypes, restype


def library() -> ctypes.CDLL:
    """The loaded kernels (for modules that wrap their own, after declare()); raises when unavailable."""
    return _need()


def available() -> bool:
    """Whether the kernels are switched on and loaded (compiles them on the first call)."""
    if not SWITCH.on():
        return False
    return _lib is not None if _tried else _load() is not None


def use_cpu_kernels(enabled: Optional[bool]) -> None:
    """Force the kernels on (True, if they load) or off (False) for the process; None = the default (on)."""
    SWITCH.set(enabled)


forced = SWITCH.forced  # temporarily force the switch (tests, A/B benchmarks)


def _need() -> ctypes.CDLL:
    lib = _lib if _tried else _load()
    if lib is None:
        raise RuntimeError("native CPU kernels are not available (see the warning logged when they failed to load)")
    return lib


def accepts(x: torch.Tensor) -> bool:
    """A tensor the kernels handle: fp32 on CPU with unit stride in its last dim."""
    return x.device.type == "cpu" and x.dtype == torch.float32 and x.stride(-1) == 1


def _ptr(t: Optional[torch.Tensor]):
    return None if t is None else t.data_ptr()


# ---- the kernels ---------------------------------------------------------------------------------


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, residual: Optional[torch.Tensor] = None):
    shape, hidden = x.shape, x.shape[-1]
    x2 = x.reshape(-1, hidden)  # a view unless the rows are unevenly strided (then a copy)
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    out = torch.empty(shape, dtype=x.dtype)
    res_out = None
    if residual is not None:
        residual = residual.contiguous()
        res_out = torch.empty(shape, dtype=x.dtype)
    _need().rms_norm_f32(x2.data_ptr(), _ptr(residual), weight.contiguous().data_ptr(), out.data_ptr(),
                      _ptr(res_out), x2.shape[0], hidden, x2.stride(0), eps, torch.get_num_threads())
    return out if res_out is None else (out, res_out)


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    x = x.contiguous()
    d = x.shape[-1] // 2
    out = torch.empty((*x.shape[:-1], d), dtype=x.dtype)
    _need().silu_and_mul_f32(x.data_ptr(), out.data_ptr(), x.numel() // (2 * d) if d else 0, d, torch.get_num_threads())
    return out


def gelu_tanh_and_mul(x: torch.Tensor) -> torch.Tensor:
    x = x.contiguous()
    d = x.shape[-1] // 2
    out = torch.empty((*x.shape[:-1], d), dtype=x.dtype)
    _need().gelu_tanh_and_mul_f32(x.data_ptr(), out.data_ptr(), x.numel() // (2 * d) if d else 0, d,
                                  torch.get_num_threads())
    return out


def can_rotary(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor) -> bool:
    return (
        q.dim() == 3 and k.dim() == 3 and accepts(q) and accepts(k) and cos.dtype == torch.float32
        and q.stride(1) == q.shape[2] and k.stride(1) == k.shape[2]
    )


def rotary_(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
    """q [N, H, D], k [N, Hk, D] (rows may be strided views of one qkv buffer); cos/sin [N, 1, rot]."""
    n, h, d = q.shape
    rot = cos.shape[-1]
    cos = cos.reshape(n, rot).contiguous()
    sin = sin.reshape(n, rot).contiguous()
    _need().rotary_f32(q.data_ptr(), q.stride(0), h, k.data_ptr(), k.stride(0), k.shape[1], d, rot, n,
                    cos.data_ptr(), sin.data_ptr(), torch.get_num_threads())
    return q, k


def write_kv(key: torch.Tensor, value: torch.Tensor, kv_cache: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    n = key.shape[0]
    width = kv_cache.shape[3] * kv_cache.shape[4]
    slots = slot_mapping.to(torch.int64).contiguous()
    _need().write_kv_f32(key.data_ptr(), key.stride(0), value.data_ptr(), value.stride(0),
                      kv_cache[0].data_ptr(), kv_cache[1].data_ptr(), slots.data_ptr(), n, width)


def can_write_kv(key: torch.Tensor, value: torch.Tensor, kv_cache: torch.Tensor) -> bool:
    return (
        accepts(key) and accepts(value) and kv_cache.dtype == torch.float32 and kv_cache.is_contiguous()
        and key.dim() == 3 and key.stride(1) == key.shape[2] and value.stride(1) == value.shape[2]
    )


def can_decode(query: torch.Tensor, kv_cache: torch.Tensor) -> bool:
    """Query rows [n, H, D] with contiguous heads (a qkv view is fine) over a contiguous fp32 cache."""
    return (
        accepts(query) and query.dim() == 3 and query.stride(1) == query.shape[2]
        and kv_cache.dtype == torch.float32 and kv_cache.is_contiguous()
    )


def _attention_args(query: torch.Tensor, kv_cache: torch.Tensor, block_tables: torch.Tensor):
    """Checks the GQA shape; returns (num_kv_heads, block_size, block tables as int32 with unit-stride rows)."""
    h, hk = query.shape[1], kv_cache.shape[3]
    if h % hk:
        raise ValueError(f"num_heads {h} must be a multiple of num_kv_heads {hk}")
    return hk, kv_cache.shape[2], _int32_rows(block_tables)


def _int32(t: torch.Tensor) -> torch.Tensor:
    return t.to(torch.int32).contiguous()


def _int32_rows(block_tables: torch.Tensor) -> torch.Tensor:
    """Block tables as int32 with unit-stride rows (as given when they already are: a row slice stays a view)."""
    if block_tables.dtype == torch.int32 and block_tables.stride(-1) == 1:
        return block_tables
    return block_tables.to(torch.int32).contiguous()


def _options_args(options, num_heads: int) -> Optional[tuple]:
    """(window, softcap, sinks tensor) for the *_opts_f32 kernels, or None for plain attention."""
    if options is None or options.plain:
        return None
    sinks = None
    if options.sinks is not None:
        sinks = options.sinks.detach().to(torch.float32).contiguous()
        if sinks.shape != (num_heads,):
            raise ValueError(f"attention sinks of shape {tuple(sinks.shape)} for {num_heads} query heads")
    return (options.sliding_window or 0, float(options.logit_softcap or 0.0), sinks)


def paged_decode_attention(query: torch.Tensor, kv_cache: torch.Tensor, block_tables: torch.Tensor,
                           seq_lens: torch.Tensor, scale: float, out: Optional[torch.Tensor] = None,
                           options=None) -> torch.Tensor:
    """query [n, H, D] (one row per sequence) -> [n, H, D] attending to seq_lens[i] cached tokens,
    written into `out` (contiguous) when given; `options` an attention/backend.py AttentionOptions
    (sliding window, soft-cap, sinks) or None."""
    n, h, d = query.shape
    hk, block_size, tables = _attention_args(query, kv_cache, block_tables)
    if out is None:
        out = torch.empty((n, h, d), dtype=torch.float32)
    elif not out.is_contiguous():
        raise ValueError("paged_decode_attention writes into a contiguous `out` only")
    lens = _int32(seq_lens)
    args = (query.data_ptr(), query.stride(0), out.data_ptr(), kv_cache[0].data_ptr(), kv_cache[1].data_ptr(),
            tables.data_ptr(), tables.stride(0), lens.data_ptr(), n, h, hk, d, block_size, scale)
    extra = _options_args(options, h)
    if extra is None:
        _need().paged_decode_attention_f32(*args, torch.get_num_threads())
    else:
        window, softcap, sinks = extra
        _need().paged_decode_attention_opts_f32(*args, window, softcap, None if sinks is None else sinks.data_ptr(),
                                                torch.get_num_threads())
    return out


def can_prefill(query: torch.Tensor, kv_cache: torch.Tensor) -> bool:
    """As can_decode, with a head size the 16-wide value tiles cover."""
    return can_decode(query, kv_cache) and query.shape[2] % PANEL == 0


def paged_prefill_attention(query: torch.Tensor, kv_cache: torch.Tensor, block_tables: torch.Tensor,
                            query_start_loc: torch.Tensor, seq_lens: torch.Tensor, scale: float,
                            out: torch.Tensor, options=None) -> None:
    """Causal attention of prefill chunks: request r's rows query[query_start_loc[r]:query_start_loc[r+1]]
    ([n, H, D] rows, all requests' rows in one tensor) are its last positions of seq_lens[r] cached
    tokens; results go to the same rows of `out` (contiguous [n, H, D]); `options` as for
    paged_decode_attention."""
    n, h, d = query.shape
    hk, block_size, tables = _attention_args(query, kv_cache, block_tables)
    if not out.is_contiguous() or out.shape != query.shape:
        raise ValueError("paged_prefill_attention writes into a contiguous `out` shaped like the query")
    nreq = seq_lens.shape[0]
    if query_start_loc.shape[0] != nreq + 1 or tables.shape[0] != nreq:
        raise ValueError("one block table and seq_len per request, and query_start_loc of one more")
    qsl, lens = _int32(query_start_loc), _int32(seq_lens)
    args = (query.data_ptr(), query.stride(0), out.data_ptr(), kv_cache[0].data_ptr(), kv_cache[1].data_ptr(),
            tables.data_ptr(), tables.stride(0), qsl.data_ptr(), lens.data_ptr(), nreq, h, hk, d, block_size, scale)
    extra = _options_args(options, h)
    if extra is None:
        _need().paged_prefill_attention_f32(*args, torch.get_num_threads())
    else:
        window, softcap, sinks = extra
        _need().paged_prefill_attention_opts_f32(*args, window, softcap, None if sinks is None else sinks.data_ptr(),
                                                 torch.get_num_threads())


def argmax_rows(x: torch.Tensor) -> Optional[torch.Tensor]:
    """x.argmax(dim=-1) for a 2-D fp32 CPU tensor with unit-stride rows (rows shared by the threads,
    AVX2 where built with it; first maximum wins, a NaN counts as the maximum, as in torch); None when
    the kernels cannot take x (the caller uses torch)."""
    if x.dim() != 2 or not accepts(x) or x.shape[1] == 0 or not available():
        return None
    out = torch.empty(x.shape[0], dtype=torch.int64)
    _need().argmax_rows_f32(x.data_ptr(), x.stride(0), x.shape[0], x.shape[1], out.data_ptr(), torch.get_num_threads())
    return out


def can_gemv(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """One contiguous fp32 row and a weight stored [in x out]-major (weight.t() contiguous)."""
    return (
        x.dim() == 2 and x.shape[0] == 1 and accepts(x) and x.is_contiguous() and weight.dtype == torch.float32
        and weight.dim() == 2 and weight.stride(0) == 1 and weight.stride(1) == weight.shape[0]
    )


def gemv(x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor] = None) -> torch.Tensor:
    """x [1, in] @ weight[out, in]^T (+ bias) -> [1, out], threads splitting the weight's rows (inputs)."""
    n, k = weight.shape
    y = torch.empty((1, n), dtype=torch.float32)
    b = None if bias is None else bias.contiguous()
    _need().gemv_f32(x.data_ptr(), weight.data_ptr(), _ptr(b), y.data_ptr(), k, n, weight.stride(1),
                     torch.get_num_threads())
    return y


def pack_panels(weight: torch.Tensor) -> torch.Tensor:
    """weight [out, in] fp32 -> flat panels [ceil(out/16), in, 16] (zero padded) for gemm_packed."""
    n, k = weight.shape
    wt = weight.detach().t().contiguous()  # [in x out]
    panels = torch.empty(((n + PANEL - 1) // PANEL) * k * PANEL, dtype=torch.float32)
    _need().pack_panels_f32(wt.data_ptr(), k, n, n, panels.data_ptr())
    return panels


def gemm_packed(x: torch.Tensor, panels: torch.Tensor, out_features: int,
                bias: Optional[torch.Tensor] = None) -> torch.Tensor:
    """x [M, in] @ W^T (+ bias) -> [M, out_features], W packed by pack_panels."""
    m, k = x.shape
    if panels.numel() != ((out_features + PANEL - 1) // PANEL) * k * PANEL:
        raise ValueError(f"panels of {panels.numel()} floats do not hold a [{out_features} x {k}] weight")
    if x.stride(-1) != 1:
        x = x.contiguous()
    y = torch.empty((m, out_features), dtype=torch.float32)
    b = None if bias is None else bias.contiguous()
    _need().gemm_packed_f32(x.data_ptr(), x.stride(0), panels.data_ptr(), _ptr(b), y.data_ptr(), out_features,
                            m, k, out_features, torch.get_num_threads())
    return y


def gemm_packed_silu_mul(x: torch.Tensor, panels: torch.Tensor, d: int) -> torch.Tensor:
    """silu(x W_g^T) * (x W_u^T) -> [M, d] for W = [W_g; W_u] ([2d, in], d a multiple of 16) packed by
    pack_panels: gemm_packed then silu_and_mul, without the [M, 2d] intermediate."""
    m, k = x.shape
    if d % PANEL or panels.numel() != 2 * d * k:
        raise ValueError(f"panels of {panels.numel()} floats do not hold a [2 x {d} x {k}] gate/up weight "
                         f"with {d} a multiple of {PANEL}")
    if x.stride(-1) != 1:
        x = x.contiguous()
    y = torch.empty((m, d), dtype=torch.float32)
    _need().gemm_packed_silu_mul_f32(x.data_ptr(), x.stride(0), panels.data_ptr(), y.data_ptr(), d, m, k, d,
                                     torch.get_num_threads())
    return y


MOE_ACTIVATIONS = {"silu": 0, "clamped_swiglu": 1}  # cpu_kernels.c MOE_ACT_*


def moe_experts(x: torch.Tensor, row_token: torch.Tensor, slot_row: torch.Tensor, slot_weight: torch.Tensor,
                offsets: torch.Tensor, w13_packed: torch.Tensor, w2_packed: torch.Tensor, inter: int,
                b13: Optional[torch.Tensor] = None, b2: Optional[torch.Tensor] = None, activation: str = "silu",
                alpha: float = 0.0, limit: float = 0.0) -> torch.Tensor:
    """A MoE layer's routed experts in one native call (cpu_kernels.c moe_experts_f32):
    x [N, H]; the N*k (token, slot) rows sorted by expert, sorted row r from token row_token[r] (int64 [N*k]);
    expert e's rows offsets[e]..offsets[e+1] (int64 [E+1]); (token t, slot j) at sorted row slot_row[t*k+j]
    with weight slot_weight[t*k+j] (fp32); w13_packed [E, ceil(2*inter/16)*16*H] and
    w2_packed [E, ceil(H/16)*16*inter], each expert's pack_panels of its [2*inter, H] gate/up and [H, inter]
    down weights.  Options (gpt-oss): b13 [E, 2*inter] / b2 [E, H] biases (None: none), activation "silu" or
    "clamped_swiglu" (with alpha and limit).  Plain SiLU experts without b13 need inter a multiple of 16 (the
    activation fused into the gate/up GEMM).  Returns out [N, H] = sum over k of weight * expert(x)."""
    n, h = x.shape
    e = offsets.numel() - 1
    r = row_token.numel()
    if activation not in MOE_ACTIVATIONS:
        raise ValueError(f"moe_experts: unknown activation {activation!r} (expected one of {sorted(MOE_ACTIVATIONS)})")
    fused = activation == "silu" and b13 is None
    w13_cols = -(-2 * inter // PANEL) * PANEL
    if ((fused and inter % PANEL) or w13_packed.shape != (e, w13_cols * h)
            or w2_packed.shape != (e, -(-h // PANEL) * PANEL * inter)):
        raise ValueError(f"expert panels {tuple(w13_packed.shape)} / {tuple(w2_packed.shape)} do not fit {e} experts "
                         f"of [{2 * inter} x {h}] / [{h} x {inter}]"
                         + (f" with {inter} a multiple of {PANEL}" if fused else ""))
    if n and r % n or slot_row.numel() != r or slot_weight.numel() != r:
        raise ValueError("row_token, slot_row and slot_weight must hold N*k entries each")
    if x.stride(-1) != 1:
        x = x.contiguous()
    checked = [(row_token, torch.int64), (slot_row, torch.int64), (offsets, torch.int64),
               (slot_weight, torch.float32), (w13_packed, torch.float32), (w2_packed, torch.float32)]
    for bias, want in ((b13, (e, 2 * inter)), (b2, (e, h))):
        if bias is not None:
            if tuple(bias.shape) != want:
                raise ValueError(f"moe_experts: bias of shape {tuple(bias.shape)}, expected {want}")
            checked.append((bias, torch.float32))
    for t, dtype in checked:
        if t.dtype != dtype or not t.is_contiguous():
            raise ValueError(f"moe_experts: expected a contiguous {dtype} tensor, got {t.dtype}")
    xs, ys = torch.empty((r, h), dtype=torch.float32), torch.empty((r, h), dtype=torch.float32)
    out = torch.empty((n, h), dtype=torch.float32)
    args = (x.data_ptr(), x.stride(0), n, r // n if n else 0, row_token.data_ptr(), slot_row.data_ptr(),
            slot_weight.data_ptr(), offsets.data_ptr(), e, w13_packed.data_ptr(), w2_packed.data_ptr())
    # the activations: hs [R, inter] on the fused route, else left in gu's rows [R, 2*inter]
    hs = torch.empty((r, inter) if fused else (0,), dtype=torch.float32)
    gu = torch.empty((0,) if fused else (r, 2 * inter), dtype=torch.float32)
    _need().moe_experts_f32(*args, 0 if b13 is None else b13.data_ptr(), 0 if b2 is None else b2.data_ptr(),
                            MOE_ACTIVATIONS[activation], alpha, limit, h, inter, xs.data_ptr(), hs.data_ptr(),
                            gu.data_ptr(), ys.data_ptr(), out.data_ptr(), torch.get_num_threads())
    return out


def greedy_head(hidden: torch.Tensor, screen, fp32_panels: Optional[torch.Tensor], dense: torch.Tensor,
                route_runs: int, approx: torch.Tensor, out: torch.Tensor, candidates: Optional[torch.Tensor]) -> int:
    """cpu_kernels.c greedy_head_f32 for a greedy_head.GreedyScreen: out[r] = the first argmax of row r's
    logits as the fp32 route computes them (route_runs 0: packed GEMM over fp32_panels; T > 0: gemv_f32's
    T runs over dense, [in x out]-major).  hidden [R, K] unit-stride rows; approx [R, V] scratch;
    candidates: None or int64 [R].  Returns 1 (out unset) when a row is not finite or could overflow."""
    r, k = hidden.shape
    if k != screen.k or approx.shape != (r, screen.vocab) or out.shape != (r,):
        raise ValueError(f"greedy_head: hidden {tuple(hidden.shape)} / approx {tuple(approx.shape)} do not fit a "
                         f"[{screen.vocab} x {screen.k}] screen")
    if route_runs == 0 and (fp32_panels is None or fp32_panels.numel() < -(-screen.vocab // PANEL) * PANEL * k):
        raise ValueError("greedy_head: the packed route needs the LM head's fp32 panels")
    if route_runs > 0 and not (dense.dim() == 2 and dense.stride(0) == 1 and dense.shape[1] == k
                               and dense.shape[0] >= screen.vocab):
        raise ValueError("greedy_head: the GEMV route needs the dense weight stored [in x out]-major")
    return int(_need().greedy_head_f32(
        hidden.data_ptr(), hidden.stride(0), r, k, screen.vocab, screen.panels.data_ptr(), screen.scales.data_ptr(),
        screen.bound_w.data_ptr(), screen.bound_q.data_ptr(), screen.wnorm_max, GREEDY_HQ_MAX,
        _ptr(fp32_panels), dense.data_ptr(), dense.stride(1), route_runs, approx.data_ptr(), out.data_ptr(),
        _ptr(candidates), torch.get_num_threads()))


def route_logits(h: torch.Tensor, ids: torch.Tensor, fp32_panels: Optional[torch.Tensor], dense: torch.Tensor,
                 route_runs: int) -> torch.Tensor:
    """The logits of tokens ids (int64) for one row h [K] as greedy_head rescores them: the fp32 route's
    products and sums in its order (route_runs 0: packed GEMM, T > 0: GEMV with T runs)."""
    h, ids = h.contiguous(), ids.to(torch.int64).contiguous()
    out = torch.empty(ids.shape[0], dtype=torch.float32)
    _need().route_logits_f32(h.data_ptr(), h.shape[0], ids.data_ptr(), ids.shape[0], _ptr(fp32_panels),
                             dense.data_ptr(), dense.stride(1), route_runs, out.data_ptr())
    return out


def llama_stack_fields() -> int:
    """How many addresses llama_stack reads per layer (the C enum's STACK_FIELDS)."""
    return int(_need().llama_stack_fields())


def llama_stack_lora_fields() -> int:
    """How many values llama_stack reads per projection's LoRA slots (the C enum's STACK_LORA_FIELDS)."""
    return int(_need().llama_stack_lora_fields())


def llama_stack(x: torch.Tensor, out: torch.Tensor, layers: torch.Tensor, dims: torch.Tensor, eps: float,
                scale: float, final_norm: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                slot_mapping: torch.Tensor, num_decodes: int, query_start_loc: torch.Tensor, seq_lens: torch.Tensor,
                block_tables: torch.Tensor, keep: Optional[torch.Tensor] = None, lora=None) -> None:
    """Every decoder layer of one step (cpu_kernels.c llama_stack_f32): x [N, d] embedded tokens ->
    out [N, d] final-normed hidden states, or out [K, d] for rows `keep` (K strictly increasing row
    indices) alone.  layers: int64 [L, fields] addresses (0 = absent), dims: int64 (d, H, H_kv, D, I, rot,
    block_size); cos/sin [N, rot]; the rest as in AttentionMetadata.  lora: None, or (table int64
    [L, 4, lora fields], the slots' rank, groups int64 [G, 4], kept groups int64 [G', 4]) -- LoRA adapter
    rows' deltas (cpu_kernels.c's doc).  The caller keeps every addressed tensor alive and checks shapes
    and that keep is increasing (llama_cpu_stack.CpuLayerStack)."""
    n = x.shape[0]
    kept = _int32(keep) if keep is not None else None
    if out.shape[0] != (n if kept is None else kept.shape[0]):
        raise ValueError(f"llama_stack: out has {out.shape[0]} rows")
    tables = _int32_rows(block_tables)
    slots, qsl, lens = slot_mapping.to(torch.int64).contiguous(), _int32(query_start_loc), _int32(seq_lens)
    table, rank, groups, kept_groups = lora if lora is not None else (None, 0, None, None)
    rc = _need().llama_stack_f32(
        x.data_ptr(), out.data_ptr(), n, layers.data_ptr(), layers.shape[0], dims.data_ptr(), eps, scale,
        final_norm.data_ptr(), cos.data_ptr(), sin.data_ptr(), slots.data_ptr(), num_decodes, seq_lens.shape[0],
        qsl.data_ptr(), lens.data_ptr(), tables.data_ptr(), tables.stride(0), 0 if kept is None else kept.data_ptr(),
        0 if kept is None else kept.shape[0], 0 if table is None else table.data_ptr(), rank,
        0 if groups is None else groups.data_ptr(), 0 if groups is None else groups.shape[0],
        0 if kept_groups is None else kept_groups.data_ptr(), 0 if kept_groups is None else kept_groups.shape[0],
        torch.get_num_threads())
    if rc != 0:
        raise RuntimeError("llama_stack: the LoRA kernel refused its arguments")


# ---- MLA latent decode (cpu_kernels.c's section of the same name; self-contained) -----------------

_SIGNATURES["mla_decode_f32"] = [_P, _P, _P, _P, _I, _P, _I, _I, _I, _I, _I, _F, ctypes.c_int]


def can_mla_decode(q_abs: torch.Tensor, cache: torch.Tensor) -> bool:
    """Absorbed decode queries [n, h, L + R] and a contiguous fp32 latent cache [1, blocks, bs, 1, L + R]."""
    return (accepts(q_abs) and q_abs.dim() == 3 and cache.dtype == torch.float32 and cache.is_contiguous()
            and cache.dim() == 5 and cache.shape[0] == 1 and cache.shape[3] == 1 and cache.shape[4] == q_abs.shape[2])


def mla_decode(q_abs: torch.Tensor, cache: torch.Tensor, block_tables: torch.Tensor, seq_lens: torch.Tensor,
               latent_rank: int, scale: float) -> torch.Tensor:
    """Each decode row's heads attend over its latent rows as one shared KV head: [n, h, L + R] -> [n, h, L]
    (values = the first latent_rank entries of each row); the torch reference is
    MLAAttentionBackend.latent_attention."""
    n, h, width = q_abs.shape
    q_abs = q_abs.contiguous()
    tables = block_tables.to(torch.int32)
    if tables.dim() != 2 or tables.stride(1) != 1:
        tables = tables.contiguous()
    lens = seq_lens.to(torch.int32).contiguous()
    out = torch.empty((n, h, latent_rank), dtype=torch.float32)
    _need().mla_decode_f32(q_abs.data_ptr(), out.data_ptr(), cache.data_ptr(), tables.data_ptr(), tables.stride(0),
                           lens.data_ptr(), n, h, latent_rank, width, cache.shape[2], scale, torch.get_num_threads())
    return out
