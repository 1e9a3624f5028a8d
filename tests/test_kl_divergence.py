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
