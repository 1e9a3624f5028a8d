"""Agreement with llama.cpp as llama.cpp measures it (issue 48): our token distributions
written in llama-perplexity's --kl-divergence-base format, and llama-perplexity's KL
divergence of llama.cpp's distributions against ours on real files (engine.bench.kl_divergence).

The format tests need nothing built; the real-file tests run llama.cpp's llama-perplexity
(scripts/build_llama_server.sh) on the files engine.bench.real_files makes."""
import numpy as np
import pytest
import torch

from engine.bench import kl_divergence as kld


def decoded(row: np.ndarray, n_vocab: int) -> np.ndarray:
    """A stored row read back as llama.cpp's kl_divergence reads it: scale * q + min_log_prob."""
    scale, min_log_prob = row[:4].view("<f4")
    return scale * row[4:4 + n_vocab].astype(np.float64) + min_log_prob


def test_a_written_base_reads_back_with_its_tokens_and_log_probs(tmp_path):
    torch.manual_seed(0)
    n_ctx, n_vocab = 8, 101                      # odd: one uint16 of padding per row
    tokens = list(range(3, 3 + 2 * n_ctx))
    chunks = [torch.randn(n_ctx - 1 - n_ctx // 2, n_vocab) * 4 for _ in range(2)]
    path = tmp_path / "base.bin"
    kld.write_base(path, n_ctx, n_vocab, tokens, chunks)
    assert kld.read_header(path) == (n_ctx, n_vocab, 2, tokens)
    rows = np.fromfile(path, dtype="<u2", offset=8 + 12 + 4 * len(tokens))
    width = kld.row_width(n_vocab)
    assert width == 106 and rows.size == 2 * 3 * width          # nothing more, nothing less
    for i, row in enumerate(rows.reshape(-1, width)):
        logits = chunks[i // 3][i % 3].double()
        want = torch.log_softmax(logits, -1).numpy()
        kept = want >= want.max() - kld.LOG_PROB_FLOOR            # what llama.cpp keeps
        scale = row[:2].view("<f4")[0]
        assert np.abs(decoded(row, n_vocab)[kept] - want[kept]).max() <= scale / 2 + 1e-5
        assert decoded(row, n_vocab).argmax() == want.argmax()


def test_a_file_that_is_not_a_base_is_refused(tmp_path):
    from engine.errors import WorkbenchError
    path = tmp_path / "not.bin"
    path.write_bytes(b"GGUF" + bytes(40))
    with pytest.raises(WorkbenchError, match="not a llama-perplexity --kl-divergence-base file"):
        kld.read_header(path)


# ---- on real files, against llama.cpp --------------------------------------------------------
N_CTX, CHUNKS = 256, 2          # 254 scored positions: llama-perplexity reports from 100


def real_file(kind: str):
    from engine.bench import real_files
    from engine.errors import WorkbenchError
    try:
        return real_files.smollm2(kind)
    except WorkbenchError as e:
        pytest.fail(str(e))            # scripts/test.sh builds llama.cpp's tools and makes the files


def test_on_the_f32_file_llama_cpp_and_ours_give_one_distribution():
    f32 = real_file("F32")
    out = kld.against_llama_cpp(f32, None, n_ctx=N_CTX, chunks=CHUNKS, paths=("auto",), noise=False)
    assert out["scored_tokens"] == 254
    row = out["paths"][0]["llama_cpp_vs_ours"]
    assert row["mean_kld"] <= kld.F32_TARGET and row["kld_99"] <= 1e-3
    assert row["same_top"] >= kld.SAME_TOP_TARGET


def test_on_a_k_quant_file_ours_is_closer_to_llama_cpp_than_the_file_is_to_f32():
    """Q4_K_M: llama.cpp's KLD against ours is at most a quarter of the file's own against F32
    (measured 0.0062 against 0.046 at these 254 positions), and our weights as stored are no
    further from the exact arithmetic (the same weights dequantized, no activation rounding)
    than llama.cpp's are (measured 0.0049 and 0.0045). Same top token: both engines round each
    linear's input to 8 bits, so a near tie can go either way; llama.cpp beside itself with only
    its attention's rounding changed keeps the same top token at 96.9% of these positions, ours
    beside it at 96.1%: the bound is set under both, not at the issue's 98% (docs/benchmarks.md)."""
    out = kld.against_llama_cpp(real_file("Q4_K_M"), real_file("F32"), n_ctx=N_CTX, chunks=CHUNKS,
                                paths=("auto", "float"), noise=False)
    stored = out["paths"][0]
    assert stored["path"] == "auto" and "Q4_K super-blocks as stored" in stored["weight_dtype"]
    assert out["file_vs_reference"]["mean_kld"] > 0.01                 # a real quantization error: the scale
    assert stored["ratio_to_file_error"] <= kld.KLD_SHARE_TARGET
    assert stored["llama_cpp_vs_ours"]["same_top"] >= 0.94
    exact = out["from_exact"]
    assert exact["ours_auto_native"]["mean_kld"] <= 1.5 * exact["llama_cpp"]["native"]["mean_kld"]
