"""The bf16 copy of the weights that bf16 products read (train.dtype bfloat16 on the cpu).

The float32 weights stay the ones AdamW updates; the products read `flat_params16`, the trained
weights narrowed to bf16 (a frozen LoRA base is held as bf16 only, models/lora_layout.py's frozen16,
and read as it is). AdamW's pass writes both (params_bf16); anything else that writes the float32
weights (a load, a broadcast, the update of one ZeRO shard) says so with weights_changed(), and
the next forward narrows them again.
"""
import numpy as np

from .params import flat_views


class BF16Copies:
    """Mixed into models/family.py's FlatModel: `p16` names the tensors the families' products read
    (model.p itself with float32 products), `narrowed` gives a product its input as bf16."""

    def _init_bf16_copies(self, padded):
        """flat_params16 (padded,) uint16 beside flat_params where the products are bf16, else None;
        p16 over it and the frozen tensors (model.p's views where a tensor has no copy)."""
        self.flat_params16 = self.ops.empty((padded,), np.uint16) if self.bf16_products else None
        self.p16 = {**self.p, **flat_views(self.flat_params16, self.layout)} if self.bf16_products else self.p
        self._weights16_fresh = False

    def weights_changed(self):
        """Say that the float32 weights were written outside the optimizer (loaded, broadcast,
        gathered): a bf16 model narrows them again before its next forward."""
        self._weights16_fresh = False

    def weights16_updated(self):
        """Say that the bf16 copy matches the float32 weights again (AdamW wrote both)."""
        self._weights16_fresh = True

    def _narrow_weights(self):
        if self.bf16_products and not self._weights16_fresh:
            self.ops.to_bf16(self.flat_params, self.flat_params16)
            self._weights16_fresh = True

    def narrowed(self, x, buf, l=None):
        """x as a bf16 product's input: narrowed into buf (buf[l] if l is given), or x itself where
        buf is None (float32 products)."""
        if buf is None:
            return x
        out = buf if l is None else buf[l]
        self.ops.to_bf16(x, out)
        return out
