"""Shared test helpers (imported by the test modules; pytest puts tests/ on sys.path)."""
import numpy as np
import pytest

from handgrad.backends import cpu as ops

HEADER = f"{'op':<18} {'quantity':<28} {'max abs':>10} {'max rel':>10} {'tol':>8}"


def format_rows(rows):
    return "\n".join([HEADER] + [r.line() for r in rows])


def assert_rows(rows, context=""):
    """Fail, printing the failing rows (where and how big the largest differences are) and then
    every row, unless every Row passed."""
    rows = list(rows)
    assert rows, "the check returned no rows: nothing was compared"
    failed = [r for r in rows if not r.ok]
    if failed:
        head = f"{len(failed)} of {len(rows)} rows failed" + (f" ({context})" if context else "")
        pytest.fail(f"{head}:\n{format_rows(failed)}\n\nall rows:\n{format_rows(rows)}", pytrace=False)



def run_crossentropy(logits, targets):
    """handgrad's loss, per-row losses and in-place dlogits, called as the model calls them."""
    B, T, _ = logits.shape
    losses, lse = np.empty((B, T), logits.dtype), np.empty((B, T), np.float64)
    buf = logits.copy()
    loss = ops.crossentropy_forward(losses, lse, buf, targets)
    ops.crossentropy_backward(buf, buf, lse, targets)
    return loss, losses, lse, buf


def prepared_char_data(root, text):
    """A data directory made by `handgrad prepare` from `text` (char tokenizer, 10% val) under root."""
    from handgrad.data import prepare
    (root / "text.txt").write_text(text)
    prepare([str(root / "text.txt")], root / "data", tokenizer="char", val_fraction=0.1, seed=1)
    return root / "data"
