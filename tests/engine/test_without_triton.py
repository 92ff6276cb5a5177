"""triton is an optional extra (pip install ostinato[triton]): on CPU, LLM(...) runs on torch kernels alone.

Each test runs a fresh interpreter whose first meta-path finder refuses `triton`, as on a machine without it,
so that nothing imported earlier by this test process can hide an import.
"""

import json
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from ostinato import LLM, SamplingParams
from ostinato.tools.checkpoint import make_checkpoint

SRC = Path(__file__).resolve().parents[2] / "src"
PROMPTS = [[5, 6, 7], [8, 9, 10, 11]]
ENGINE = dict(device="cpu", dtype="float32", num_kv_blocks=64, max_model_len=64)

BLOCK_TRITON = textwrap.dedent(f"""
    import importlib.abc, json, sys
    sys.path.insert(0, {str(SRC)!r})

    class NoTriton(importlib.abc.MetaPathFinder):
        def find_spec(self, name, path=None, target=None):
            if name == "triton" or name.startswith("triton."):
                raise ModuleNotFoundError(f"No module named {{name!r}}", name=name)
            return None

    sys.meta_path.insert(0, NoTriton())
""")


def run_without_triton(body: str, *args: str) -> dict:
    """Run `body` (after the blocker) in a fresh interpreter; it prints one JSON object, returned here."""
    proc = subprocess.run([sys.executable, "-c", BLOCK_TRITON + textwrap.dedent(body), *args],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    path = tmp_path_factory.mktemp("no-triton-ckpt")
    make_checkpoint(path, shape="tiny", family="llama", seed=1)
    return path


def test_llm_generates_on_cpu_without_triton(checkpoint):
    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    want = [o.outputs[0].token_ids for o in LLM(str(checkpoint), **ENGINE).generate(PROMPTS, params)]
    got = run_without_triton(f"""
        from ostinato import LLM, SamplingParams
        llm = LLM(sys.argv[1], **{ENGINE!r})
        outs = llm.generate({PROMPTS!r}, SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True))
        print(json.dumps({{"tokens": [o.outputs[0].token_ids for o in outs],
                          "triton_loaded": any(m.split(".")[0] == "triton" for m in sys.modules)}}))
    """, str(checkpoint))
    assert got == {"tokens": want, "triton_loaded": False}


def test_only_the_triton_kernels_need_triton():
    """Every module imports without triton except those that hold Triton kernels and the Triton attention
    backend (CUDA only) that launches them: a host-side module (a launch plan, a config type) must not."""
    got = run_without_triton("""
        import importlib, pkgutil
        import ostinato

        failed = {}
        for info in pkgutil.walk_packages(ostinato.__path__, "ostinato."):
            if info.name.endswith("__main__"):
                continue
            try:
                importlib.import_module(info.name)
            except ImportError as e:
                failed[info.name] = (sys.modules.get(info.name) or importlib.util.find_spec(info.name)).origin
        print(json.dumps(failed))
    """)
    assert got, "the blocker blocked nothing: the kernel modules should fail to import"
    host_side = sorted(name for name, origin in got.items()
                       if name != "ostinato.attention.triton_paged" and "@triton.jit" not in Path(origin).read_text())
    assert not host_side, f"these modules hold no Triton kernel but need triton to import: {host_side}"
