"""Where a model holds each of param_spec's tensors, and the digest of a base held as bf16.

What trains (model.spec: every tensor, or a LoRA model's adapters and what train_norms /
train_embeddings add) lies in flat_params. What a LoRA model freezes lies in frozen_params
(float32, no gradient), except that with bf16 products (train.dtype bfloat16 on the cpu) its frozen
matrices lie in frozen16 as bf16 only: they never change, so no float32 copy is kept. model.p names
every tensor wherever it lies, in param_spec's order, the adapters last.

Under lora.base_quant (train.base_quant) the base's block linears are held as GGUF blocks instead
(`quant`: name -> QuantMatrix, backends/cpu/quant_matrix.py): keep takes a GGUF base's blocks as
stored (interop/gguf.py's GGUFTensor.blocks), q8_0 and q4_0 quantize the weights as they are written.
The embeddings, the norms and an untied lm_head stay where the rest of the frozen base is.

A base held as bf16 or quantized cannot be hashed later as the float32 weights it was made from, so
its weights_digest (models/lora.py) is taken while they are drawn or loaded: `base_sha256`. It names
the base's weights as given, whatever base_quant holds of them (keep's GGUF blocks dequantized are
those weights exactly), so adapters decode over the same file held another way (sample --quant).
"""
import hashlib

import numpy as np

from ..backends.cpu.quant_matrix import QUANT_TYPES, QUANTIZERS, QuantMatrix, coalesce, row_bytes
from .lora import layer_of
from .params import flat_layout, flat_views


HEAD = ("model.embed_tokens.weight", "lm_head.weight")  # a Llama-family model's embedding and lm_head
HEAD_TYPE = 8  # Q8_0: the lm_head of a model decoded from q8_0 or q4_0 blocks, as llama.cpp keeps it wider


def quantized_names(frozen, head=False):
    """The frozen tensors a quantized base holds as blocks: every block's matrices; head: also the
    embedding and lm_head (a model that only decodes: the embedding's rows are dequantized as looked up)."""
    return {n for n, s in frozen if len(s) == 2 and (layer_of(n) is not None or (head and n in HEAD))}


class LoRALayout:
    """Mixed into models/family.py's FlatModel: the frozen buffers and their layouts (frozen_layout,
    frozen16_layout), model.p over all the buffers, fused_view, and the writes of the weights that
    keep base_sha256."""

    def _init_frozen(self, frozen):
        """frozen, the (name, shape) of param_spec's tensors that do not train, laid out in
        frozen_params and frozen16; then model.p over them and the trained tensors."""
        held = quantized_names(frozen, head=self.lora is None) if self.base_quant != "none" else set()
        self.quant = {n: self._quant_matrix(n, s) for n, s in frozen if n in held}
        frozen = [(n, s) for n, s in frozen if n not in held]
        frozen16 = [(n, s) for n, s in frozen if len(s) >= 2] if self.bf16_products else []
        self.frozen_layout, n_frozen = flat_layout([(n, s) for n, s in frozen if not (frozen16 and len(s) >= 2)])
        self.frozen_params = self.ops.zeros((n_frozen,))
        self.frozen16_layout, n16 = flat_layout(frozen16)
        self.frozen16 = self.ops.zeros((n16,), np.uint16) if frozen16 else None
        self.num_frozen = n_frozen + n16 + sum(qm.shape[0] * qm.shape[1] for qm in self.quant.values())
        self.base_sha256 = None  # a bf16 or quantized base's weights_digest, of the float32 weights it was made from
        trained = flat_views(self.params, self.layout)
        self.p = flat_views(self.frozen_params, self.frozen_layout)
        self.p.update(flat_views(self.frozen16, self.frozen16_layout) if frozen16 else {})
        self.p.update((n, qm.T if self.FAN_IN_FAN_OUT else qm) for n, qm in self.quant.items())
        self.p = {name: self.p.get(name, trained.get(name)) for name, _ in self.param_spec(self.config)}
        self.p.update((name, view) for name, view in trained.items() if name not in self.p)  # the adapters

    def _quant_matrix(self, name, shape):
        """The empty QuantMatrix that will hold base matrix `name` (param_spec's shape; GPT-2's Conv1D
        [in, out] is held as [out, in], rows along its input), its rows checked against the blocks of
        the type it is quantized to (keep: the file's, checked as it is written)."""
        rows, cols = shape[::-1] if self.FAN_IN_FAN_OUT else shape
        qtype = self._quant_type(name)
        if qtype is not None:
            try:
                row_bytes(qtype, cols)
            except ValueError as e:
                raise ValueError(f"train.base_quant {self.base_quant}: {name}: {e}; choose train.base_quant "
                                 f"none") from None
        return QuantMatrix(rows, cols, np.uint16 if self.bf16_products else np.float32, conv1d=self.FAN_IN_FAN_OUT)

    def _quant_type(self, name):
        """The GGML type base matrix `name` is quantized to (None: keep's, the file's)."""
        qtype = QUANT_TYPES.get(self.base_quant)
        return HEAD_TYPE if qtype is not None and name in HEAD else qtype

    def _write_quantized(self, name, arr, digest):
        """Base matrix `name` from arr (a float32 array, or a GGUF tensor that gives its blocks) into
        its QuantMatrix: keep takes the blocks as stored, q8_0 / q4_0 quantize it. digest: fed the
        weights it was given (a GGUF tensor's dequantized: the same), so the digest names the base
        file whatever base_quant holds of it."""
        qm, quant = self.quant[name], self.base_quant
        if quant == "keep":
            if not hasattr(arr, "blocks"):
                raise ValueError(f"keep holds a GGUF file's blocks as stored, but {name} was not read from a GGUF "
                                 f"file; choose q8_0 or q4_0")
            qm.set_parts([arr.blocks()])
            w = qm.with_dtype(np.float32).dequantize() if digest is not None else None
            w = w.T if w is not None and self.FAN_IN_FAN_OUT else w
        else:
            w, qtype = np.asarray(arr, dtype=np.float32), self._quant_type(name)
            qm.set_parts([(qtype, QUANTIZERS[qtype](w.T if self.FAN_IN_FAN_OUT else w))])
        if digest is not None:
            digest.update(f"{name}:{tuple(self.p[name].shape)};".encode())
            digest.update(np.ascontiguousarray(w).data)

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
        elif first in self.quant:  # the fused rows of consecutive quantized matrices, not copied
            names = list(self.p)
            return QuantMatrix.stack([self.quant[n] for n in names[names.index(first):names.index(last) + 1]])
        elif first in self.frozen_layout:
            buf, layout = self.frozen_params, self.frozen_layout
        else:
            buf, layout = self.frozen16, self.frozen16_layout
        o = layout[first][0]
        end = layout[last][0] + int(np.prod(layout[last][1]))
        return buf[o:end].reshape((-1, *layout[first][1][1:]))

    def _draw_weights(self, seed):
        """init_params' weights drawn into model.p's views (no second copy), a bf16 or quantized base's
        digest taken as they are drawn. A quantized base's matrices are drawn into a float32 scratch
        a tensor at a time, each quantized when the next is asked for."""
        digest = hashlib.sha256() if self.frozen16 is not None or self.quant else None
        drawn = []

        def into(name):
            if drawn:  # the previous tensor is whole now
                self._write_quantized(*drawn.pop(), None)
            if name not in self.quant:
                return self.p[name]
            scratch = np.empty(self.p[name].shape, np.float32)
            if self.base_quant != "keep":  # keep's blocks come from its GGUF file alone, loaded next
                drawn.append((name, scratch))
            return scratch
        self.init_params(self.config, seed, into=into, digest=digest)
        if drawn:
            self._write_quantized(*drawn.pop(), None)
        if self.quant and self.base_quant != "keep":
            self._coalesce()
        self.base_sha256 = digest.hexdigest() if digest is not None and self.base_quant != "keep" else None

    def _write_weights(self, state, names):
        """state's tensors `names` into the buffers that hold them, in param_spec's order (a frozen
        bf16 matrix narrowed). Where they are every base weight of a bf16 base, base_sha256 becomes
        their digest; where only some, it is forgotten; adapters alone leave it as it is."""
        base, wanted = set(self.base_names), set(names)
        kept = self.frozen16 is not None or bool(self.quant)  # a base whose float32 weights are not held
        digest = hashlib.sha256() if kept and wanted.issuperset(base) else None
        if kept and wanted.intersection(base):
            self.base_sha256 = None
        for name in [n for n in self.p if n in wanted]:  # param_spec's order: the digest's
            if name in self.quant:
                self._write_quantized(name, state[name], digest)
                continue
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
        if wanted.intersection(self.quant):
            self._coalesce()

    def _coalesce(self):
        """Each product's quantized matrices (q|k|v, gate|up: the family's LORA_MODULES groups) in one
        buffer where they share a type (quant_matrix.coalesce): one matrix to the fused decode step."""
        for l in range(self.config.n_layer):
            groups = {}
            for module, group in self.LORA_MODULES.values():
                groups.setdefault(group, []).append(self.block_prefix(l) + module + ".weight")
            for names in groups.values():
                if len(names) > 1 and all(n in self.quant and self.quant[n].parts for n in names):
                    coalesce([self.quant[n] for n in names])
