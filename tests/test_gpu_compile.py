"""Every Triton kernel of a full-size training step and of decoding compiles to an H100 (sm_90)
cubin, without a GPU: tools/compile_sm90.py records the launches of a GPT-2-width step (kernels
not run) under the interpreter, then compiles each specialisation with the launch options a GPU
would use, and checks each fits the H100's shared memory. The interpreter accepts code that the
compiler rejects; this is the check that does not depend on it."""
import subprocess
import sys
from pathlib import Path

import pytest

triton = pytest.importorskip("triton", reason="needs triton (pip install -e '.[test]')")
TOOL = Path(__file__).resolve().parent.parent / "tools" / "compile_sm90.py"
# each step's limit: the recording runs the interpreter on one core, over 8 minutes (and past 10 while
# other work shared the cores) on the 2-core AVX2 AMD EPYC, 2026-11-26
STEP_TIMEOUT = 1800


def _ptxas_available():
    import shutil
    bundled = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "ptxas"
    return bundled.is_file() or shutil.which("ptxas") is not None


def _compiled_from(tmp_path, test_name, selection):
    """The `ok` lines of tools/compile_sm90.py's compile of the launches recorded from the tests of
    tests/test_name selected by `-k selection` (the interpreter records; the compile takes a GPU's
    launch options)."""
    kernels = tmp_path / "kernels.json"
    env = {k: v for k, v in __import__("os").environ.items() if k != "TRITON_INTERPRET"}
    test_file = Path(__file__).resolve().parent / test_name
    rec = subprocess.run([sys.executable, str(TOOL), "record", str(kernels), str(test_file), "-q", "-k", selection],
                         capture_output=True, text=True, env=env, timeout=STEP_TIMEOUT)
    assert rec.returncode == 0, rec.stdout[-3000:] + rec.stderr[-3000:]
    out = subprocess.run([sys.executable, str(TOOL), "compile", str(kernels)],
                         capture_output=True, text=True, env=env, timeout=STEP_TIMEOUT)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    return [line for line in out.stdout.splitlines() if line.startswith("ok")]


@pytest.mark.skipif(not _ptxas_available(), reason="this triton build has no NVIDIA backend with ptxas")
def test_full_size_kernels_compile_for_sm90(tmp_path):
    kernels = tmp_path / "kernels.json"
    env = {k: v for k, v in __import__("os").environ.items() if k != "TRITON_INTERPRET"}
    rec = subprocess.run([sys.executable, str(TOOL), "record-sizes", str(kernels), "--quick"],
                         capture_output=True, text=True, env=env, timeout=STEP_TIMEOUT)
    assert rec.returncode == 0, rec.stderr[-3000:]
    out = subprocess.run([sys.executable, str(TOOL), "compile", str(kernels)],
                         capture_output=True, text=True, env=env, timeout=STEP_TIMEOUT)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    last = out.stdout.strip().splitlines()[-1]
    done, total = last.split(": ")[1].split(" compiled")[0].split(" of ")
    assert done == total and int(total) >= 30, last
    names = out.stdout
    for kernel in ("_adamw_kernel", "_prepare_update_kernel", "_encoder_backward_wte_kernel",
                   "_rmsnorm_forward_kernel", "_rmsnorm_backward_kernel", "_swiglu_forward_kernel",
                   "_swiglu_backward_kernel", "_rope_kernel", "_gqa_forward_kernel", "_gqa_backward_dq_kernel",
                   "_gqa_backward_dkdv_kernel", "_gqa_decode_kernel", "_dropout_kernel", "_crossentropy_fused_kernel"):
        assert kernel in names, f"{kernel} was not launched by the recorded step"
    for kernel in ("_gqa_forward_kernel", "_gqa_backward_dq_kernel", "_gqa_backward_dkdv_kernel"):
        for fused in ("'DROPOUT': True, 'HAS_DOCS': False, 'HAS_WINDOW': False, 'HS': 64, 'ROPE': True",
                      "'DROPOUT': False, 'HAS_DOCS': False, 'HAS_WINDOW': False, 'HS': 64, 'ROPE': True"):
            assert any(kernel in line and fused in line for line in names.splitlines()), (kernel, fused)
    # with the GPU's block sizes, not the wider ones the interpreter takes (adamw.BLOCK)
    adamw = [line for line in names.splitlines() if "_adamw_kernel" in line or "_sumsq_kernel" in line]
    assert adamw and all("'BLOCK': 1024," in line for line in adamw), adamw


@pytest.mark.skipif(not _ptxas_available(), reason="this triton build has no NVIDIA backend with ptxas")
def test_the_dropout_kernel_compiles_for_sm90(tmp_path):
    """Dropout is not in a model's step yet (issue 20 wires it in): its launches are recorded from
    its own tests instead, float32 and bf16, and compiled the same way."""
    compiled = [line for line in _compiled_from(tmp_path, "test_gpu_lora_dropout.py", "dropout")
                if "_dropout_kernel" in line]
    assert len(compiled) >= 2, compiled  # float32 and bf16 outputs
    assert all("'BLOCK': 256" in line for line in compiled), compiled  # the GPU's, not the interpreter's


@pytest.mark.skipif(not _ptxas_available(), reason="this triton build has no NVIDIA backend with ptxas")
def test_the_gemma3_kernels_compile_for_sm90(tmp_path):
    """Gemma 3's ops are not in a model's step here: the sliding-window attention kernels (HAS_WINDOW,
    float32 and bf16 at head sizes 16, 64 and 256 with the launch settings a GPU takes, with RoPE and
    dropout), windowed decoding, GeGLU, softcapping and the softcapped cross-entropy backward are
    recorded from their own tests and compiled the same way."""
    compiled = _compiled_from(tmp_path, "test_gpu_gemma3_ops.py",
                              "T13 or bf16 or rope_and_dropout or decoding or geglu or softcap")
    for kernel in ("_gqa_forward_kernel", "_gqa_backward_dq_kernel", "_gqa_backward_dkdv_kernel"):
        for variant in ("'DROPOUT': False, 'HAS_DOCS': False, 'HAS_WINDOW': True, 'HS': 16, 'ROPE': False",
                        "'DROPOUT': True, 'HAS_DOCS': False, 'HAS_WINDOW': True, 'HS': 16, 'ROPE': True",
                        "'DROPOUT': False, 'HAS_DOCS': False, 'HAS_WINDOW': True, 'HS': 64, 'ROPE': True",
                        "'DROPOUT': False, 'HAS_DOCS': False, 'HAS_WINDOW': True, 'HS': 256, 'ROPE': True"):
            assert any(kernel in line and variant in line for line in compiled), (kernel, variant)
    for kernel in ("_gqa_decode_kernel", "_geglu_forward_kernel", "_geglu_backward_kernel", "_softcap_kernel"):
        assert any(kernel in line for line in compiled), kernel
    assert any("_crossentropy_backward_kernel" in line and "'SOFTCAP': True" in line for line in compiled)


@pytest.mark.skipif(not _ptxas_available(), reason="this triton build has no NVIDIA backend with ptxas")
def test_the_document_mask_kernels_compile_for_sm90(tmp_path):
    """Packed documents (`positions=`) are not in a recorded step: the attention kernels' HAS_DOCS
    variants (float32 at head sizes 16, 32 and 64 with the window, RoPE and dropout; bf16 at 64 and
    256 with RoPE, the launch settings a GPU takes), RoPE's and the encoder's HAS_POS are recorded from
    their own tests and compiled the same way."""
    compiled = _compiled_from(tmp_path, "test_gpu_document_mask.py", "against_autograd or bf16 or (rope_and_dropout "
                              "and default) or gpt2 or rope_with or encoder")
    for kernel in ("_gqa_forward_kernel", "_gqa_backward_dq_kernel", "_gqa_backward_dkdv_kernel"):
        for variant in ("'DROPOUT': False, 'HAS_DOCS': True, 'HAS_WINDOW': False, 'HS': 16, 'ROPE': False",
                        "'DROPOUT': False, 'HAS_DOCS': True, 'HAS_WINDOW': True, 'HS': 64, 'ROPE': False",
                        "'DROPOUT': True, 'HAS_DOCS': True, 'HAS_WINDOW': True, 'HS': 16, 'ROPE': True",
                        "'DOT_PRECISION': 'tf32', 'DROPOUT': False, 'HAS_DOCS': True, 'HAS_WINDOW': False, 'HS': 64, "
                        "'ROPE': True",
                        "'DOT_PRECISION': 'tf32', 'DROPOUT': False, 'HAS_DOCS': True, 'HAS_WINDOW': True, 'HS': 256, "
                        "'ROPE': True"):
            assert any(kernel in line and variant in line for line in compiled), (kernel, variant)
    for kernel, variant in (("_rope_kernel", "'BACKWARD': False, 'BLOCK': 8, 'HALF': 8, 'HAS_POS': True"),
                            ("_rope_kernel", "'BACKWARD': True, 'BLOCK': 8, 'HALF': 8, 'HAS_POS': True"),
                            ("_encoder_forward_kernel", "'HAS_POS': True, 'HAS_WPE': True"),
                            ("_encoder_backward_wte_kernel", "")):
        assert any(kernel in line and variant in line for line in compiled), (kernel, variant)
