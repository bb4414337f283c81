"""model.dropout inside a family's model: where its masks fall and which seed draws each one.

The masks are never stored: each is drawn from a 64-bit seed (the backends' dropout_seed) of the
run's seed, the optimizer step, the micro-batch, the block and the site in the block, so the
backward draws the same mask again and a resumed run draws the masks it would have drawn.
"""


class Dropout:
    """Mixed into models/family.py's FlatModel: the families call drop() on a residual branch's
    output (and the embeddings), drop_grad() on its gradient, and pass attention_dropout()'s
    keywords to the attention ops; the trainer calls set_training() around a step."""

    # dropout sites (dropout_seed's `site`; models/lora.py numbers the adapters' from SITE_LORA)
    SITE_EMBED, SITE_ATTN, SITE_ATTN_OUT, SITE_MLP_OUT = 0, 1, 2, 3

    def _init_dropout(self, dropout):
        """model.dropout's probability, off until set_training(True)."""
        if not 0.0 <= dropout < 1.0:
            raise ValueError(f"model.dropout must be in [0, 1), got {dropout!r}")
        self.dropout = float(dropout)
        self.training, self.dropout_key = False, (0, 0, 0)

    def set_training(self, training, step=0, micro_step=0, seed=0):
        """Dropout on (training, with the masks of optimizer step `step`, micro-batch `micro_step`,
        keyed by the run's `seed`) or off (evaluation, sampling)."""
        self.training = bool(training)
        self.dropout_key = (int(seed), int(step), int(micro_step))

    def dropout_seed(self, layer, site):
        """The 64-bit seed of one dropout mask: (the run's seed, step, micro-step, layer, site)."""
        seed, step, micro = self.dropout_key
        return self.ops.dropout_seed(seed, step, micro, layer, site)

    def _dropping(self):
        return self.training and self.dropout > 0

    def drop(self, x, layer, site):
        """model.dropout in place on x (a residual branch's output, the embeddings) while training."""
        if self._dropping():
            self.ops.dropout_forward(x, x, self.dropout, self.dropout_seed(layer, site))

    def drop_grad(self, a, dx, layer, site):
        """The gradient entering a branch that drop() dropped: dx through the same mask (into a
        scratch buffer; dx, the residual stream's gradient, goes on unchanged), or dx itself."""
        if not self._dropping():
            return dx
        if a.dbranch is None or a.dbranch.shape != dx.shape:
            a.dbranch = self.ops.empty(dx.shape, dx.dtype)
        self.ops.dropout_backward(a.dbranch, dx, self.dropout, self.dropout_seed(layer, site))
        return a.dbranch

    def attention_dropout(self, layer):
        """The attention ops' dropout keywords for block `layer`'s probabilities ({} when off)."""
        if not self._dropping():
            return {}
        return {"dropout_p": self.dropout, "seed": self.dropout_seed(layer, self.SITE_ATTN)}
