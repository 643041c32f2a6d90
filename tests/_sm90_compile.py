"""Ahead-of-time sm_90 compiles of dsakit's Gluon kernels for the CPU suite (no GPU needed).

``compile_variants(compiler, variants, cache_dir)`` runs ``compiler(**kwargs)`` (a ``"module:function"`` path
returning Triton's CompiledKernel, e.g. ``dsakit.ops.attention.gluon:compile_gluon_kernel``) for every
variant in a fresh process without TRITON_INTERPRET (the interpreter patches triton.language in this one,
which breaks a real compile) and with an empty cache (a compile, not a cache hit), and returns per variant:
cubin bytes, shared memory, wgmma count, whether a wait leaves 0 / 1 wgmma in flight, 16 B / 8 B cp.async
counts, and ptxas -v's verdict (no spills; C7514 = ptxas serialized the wgmma, the asynchrony lost).
Skips the calling test when Triton has no Gluon or no ptxas.

``RecordedLaunch(kernel)`` stands in for a Gluon kernel object in a launcher module, so that the CPU suite
checks the launch a launcher makes (grid, arguments bound to the kernel's parameters, warps) without running
it."""

from __future__ import annotations

import inspect
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

_SCRIPT = """
import importlib, json, subprocess, sys, tempfile
from triton.backends.nvidia.compiler import get_ptxas

module, function = sys.argv[1].split(":")
compiler = getattr(importlib.import_module(module), function)

def ptxas_report(ptx):
    with tempfile.NamedTemporaryFile("w", suffix=".ptx") as f:
        f.write(ptx)
        f.flush()
        proc = subprocess.run([get_ptxas(90).path, "-arch=sm_90a", "-v", f.name, "-o", "/dev/null"],
                              capture_output=True, text=True)
    log = proc.stdout + proc.stderr
    return dict(ptxas_ok=proc.returncode == 0, no_spills=" 0 bytes spill stores, 0 bytes spill loads" in log,
                wgmma_serialized="C7514" in log, log=log[-2000:])

result = {}
for name, kw in json.loads(sys.argv[2]).items():
    try:
        kernel = compiler(**kw)
    except (FileNotFoundError, PermissionError) as exc:  # no ptxas in this Triton install
        print(json.dumps({"skip": str(exc)}))
        sys.exit(0)
    ptx = kernel.asm["ptx"]
    lines = ptx.splitlines()
    result[name] = dict(cubin=len(kernel.asm["cubin"]), shared=kernel.metadata.shared,
                        wgmma=ptx.count("wgmma.mma_async"),
                        wait0="wgmma.wait_group.sync.aligned 0" in ptx,
                        wait1="wgmma.wait_group.sync.aligned 1" in ptx,
                        cp_async_16=sum("cp.async.cg.shared.global" in l and ", 0x10," in l for l in lines),
                        cp_async_8=sum("cp.async.ca.shared.global" in l and ", 0x8," in l for l in lines),
                        **ptxas_report(ptx))
print(json.dumps(result))
"""


def compiled_variants_fixture(compiler: str, variants: dict):
    """A module-scoped fixture ``compiled_variants``: :func:`compile_variants` of ``compiler`` over
    ``variants`` once per test module, in a fresh Triton cache. Assign it to ``compiled_variants`` there."""

    @pytest.fixture(scope="module")
    def compiled_variants(tmp_path_factory):
        return compile_variants(compiler, variants, tmp_path_factory.mktemp("triton_cache"))

    return compiled_variants


def compile_variants(compiler: str, variants: dict, cache_dir: Path) -> dict:
    from dsakit.ops._backend import gluon_importable

    if not gluon_importable():
        pytest.skip("this Triton has no Gluon")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["TRITON_CACHE_DIR"] = str(cache_dir)
    env["PYTHONPATH"] = os.pathsep.join([str(Path(__file__).resolve().parents[1]), env.get("PYTHONPATH", "")])
    proc = subprocess.run([sys.executable, "-c", _SCRIPT, compiler, json.dumps(variants)], env=env,
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    if "skip" in result:
        pytest.skip(f"no sm_90 compile toolchain: {result['skip']}")
    return result


def assert_async_and_spill_free(got: dict) -> None:
    """ptxas accepted the kernel with no register spills and kept its wgmma asynchronous (no C7514)."""
    assert got["ptxas_ok"] and got["no_spills"], got["log"]
    assert not got["wgmma_serialized"], "ptxas serialized the wgmma (C7514): the async MMAs would run in order"


def needs_sm90() -> None:
    """Skip the calling gpu test unless this Triton has Gluon and the GPU is sm_90."""
    import torch

    from dsakit.ops._backend import gluon_importable

    if not gluon_importable():
        pytest.skip("this Triton has no Gluon")
    if torch.cuda.get_device_capability() != (9, 0):
        pytest.skip("the Gluon kernels run on sm_90 only")


class RecordedLaunch:
    """``kernel[grid](*args, **kwargs)`` records (grid, args, kwargs) in ``calls`` and calls ``on_launch(args)``
    (a subclass fills outputs that a later stage reads)."""

    def __init__(self, kernel):
        self.calls = []
        self.kernel = kernel

    def on_launch(self, args: tuple) -> None:
        pass

    def __getitem__(self, grid):
        def launch(*args, **kwargs):
            self.calls.append((grid, args, kwargs))
            self.on_launch(args)

        return launch

    def bound(self, num_warps: int) -> tuple[tuple, dict]:
        """-> (grid, the kernel's arguments by parameter name) of the one recorded launch, after checking that
        they bind to every parameter in order and that it asked for ``num_warps`` warps."""
        (grid, args, kwargs), = self.calls
        signature = inspect.signature(self.kernel.fn)
        launch_kwargs = dict(kwargs)
        assert launch_kwargs.pop("num_warps") == num_warps
        bound = signature.bind(*args, **launch_kwargs).arguments
        assert list(bound) == list(signature.parameters)
        return grid, bound
