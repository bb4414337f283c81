"""Where a model holds each of param_spec's tensors, and the digest of a base held as bf16.

What trains (model.spec: every tensor, or a LoRA model's adapters and what train_norms /
train_embeddings add) lies in flat_params. What a LoRA model freezes lies in frozen_params
(float32, no gradient), except that with bf16 products (train.dtype bfloat16 on the cpu) its frozen
matrices lie in frozen16 as bf16 only: they never change, so no float32 copy is kept. model.p names
every tensor wherever it lies, in param_spec's order, the adapters last.

A base held as bf16 cannot be hashed later as the float32 weights it was narrowed from, so its
weights_digest (models/lora.py) is taken while they are drawn or loaded: `base_sha256`.
"""
import hashlib

import numpy as np

from .params import flat_layout, flat_views


class LoRALayout:
    """Mixed into models/family.py's FlatModel: the frozen buffers and their layouts (frozen_layout,
    frozen16_layout), model.p over all the buffers, fused_view, and the writes of the weights that
    keep base_sha256."""

    def _init_frozen(self, frozen):
        """frozen, the (name, shape) of param_spec's tensors that do not train, laid out in
        frozen_params and frozen16; then model.p over them and the trained tensors."""
        frozen16 = [(n, s) for n, s in frozen if len(s) >= 2] if self.bf16_products else []
        self.frozen_layout, n_frozen = flat_layout([(n, s) for n, s in frozen if not (frozen16 and len(s) >= 2)])
        self.frozen_params = self.ops.zeros((n_frozen,))
        self.frozen16_layout, n16 = flat_layout(frozen16)
        self.frozen16 = self.ops.zeros((n16,), np.uint16) if frozen16 else None
        self.num_frozen = n_frozen + n16
        self.base_sha256 = None  # a bf16 base's weights_digest, of the float32 weights it was narrowed from
        trained = flat_views(self.params, self.layout)
        self.p = flat_views(self.frozen_params, self.frozen_layout)
        self.p.update(flat_views(self.frozen16, self.frozen16_layout) if frozen16 else {})
        self.p = {name: self.p.get(name, trained.get(name)) for name, _ in self.param_spec(self.config)}
        self.p.update((name, view) for name, view in trained.items() if name not in self.p)  # the adapters

    def fused_view(self, first, last, grads=False, bf16=False):
        """The [out, in] matrix (or vector) of param_spec's consecutive tensors first .. last, in the
        buffer that holds them; grads=True: its gradient, None where frozen; bf16=True: in the bf16
        copy of the weights (`flat_params16`; the float32 weights without bf16 products)."""
        if first in self.layout:
            buf, layout = (self.grad if grads else self.params), self.layout
            if bf16 and self.bf16_products:
                buf = self.flat_params16[:self.num_params]
        elif grads:
            return None
        elif first in self.frozen_layout:
            buf, layout = self.frozen_params, self.frozen_layout
        else:
            buf, layout = self.frozen16, self.frozen16_layout
        o = layout[first][0]
        end = layout[last][0] + int(np.prod(layout[last][1]))
        return buf[o:end].reshape((-1, *layout[first][1][1:]))

    def _draw_weights(self, seed):
        """init_params' weights drawn into model.p's views (no second copy), a bf16 base's digest
        taken as they are drawn."""
        digest = hashlib.sha256() if self.frozen16 is not None else None
        self.init_params(self.config, seed, into=self.p.__getitem__, digest=digest)
        self.base_sha256 = digest and digest.hexdigest()

    def _write_weights(self, state, names):
        """state's tensors `names` into the buffers that hold them, in param_spec's order (a frozen
        bf16 matrix narrowed). Where they are every base weight of a bf16 base, base_sha256 becomes
        their digest; where only some, it is forgotten; adapters alone leave it as it is."""
        base, wanted = set(self.base_names), set(names)
        digest = hashlib.sha256() if self.frozen16 is not None and wanted.issuperset(base) else None
        if self.frozen16 is not None and wanted.intersection(base):
            self.base_sha256 = None
        for name in [n for n in self.p if n in wanted]:  # param_spec's order: the digest's
            arr, view = np.asarray(state[name], dtype=np.float32), self.p[name]
            if digest is not None and name in base:
                digest.update(f"{name}:{tuple(view.shape)};".encode())
                digest.update(np.ascontiguousarray(arr).data)
            if view.dtype == np.uint16:  # a frozen bf16 matrix: narrowed
                self.ops.to_bf16(arr, view)
            else:
                view[...] = self.ops.from_numpy(arr)
        if digest is not None:
            self.base_sha256 = digest.hexdigest()
