"""The head of every family: the final linear (the lm_head) and the softmax cross-entropy, whole or
a chunk of rows at a time (`loss_chunk`, train.loss_chunk).

Whole, the (B, T, V) logits are formed, the loss read from them, and the backward overwrites them
in place with dlogits; in a training step's forward (grad=True), whose backward takes the mean
loss's gradient, the loss and dlogits come from one call (crossentropy_forward_backward: on the gpu
llm.c's fused classifier, one pass over the logits) and the backward starts at the lm_head's
products. With loss_chunk the logits never exist for the whole batch: the forward forms
them loss_chunk rows at a time, keeps each row's loss and log-sum-exp and drops the logits. Where the
forward is a training step's (forward(..., grad=True)) and the lm_head is frozen (LoRA), it also
folds each chunk's gradient into the hidden state's while the chunk's logits exist (the chunk's loss and
dlogits from one crossentropy_forward_backward call, dloss the whole batch's 1/n), as
Liger-Kernel's fused linear cross-entropy does: the head costs what the whole path costs. Otherwise
(an evaluation; a trained lm_head, whose gradient a zero_grad between forward and backward must not
lose) the backward forms each chunk's logits again, one more product of the lm_head's forward size.
Memory for the head is loss_chunk x V instead of B T V, and the hidden state's gradient (B, T, C).

With a padded vocabulary (model.vocab_pad) the lm_head holds head_rows >= V rows, the rows past V
zeros, and the logits buffer is head_rows wide: the products run over every row (aligned logits
rows), the cross-entropy and every reader of the logits over the first V columns only (`real`).
The padded columns' logits are x . 0 = 0 and stay so, and the backward, which writes dlogits over
the first V columns in place, leaves them 0: the padded rows' gradient is exactly 0.
"""
import numpy as np


def row_range(x, r0, r1):
    """Rows r0:r1 of x (B, T, ...) taken as B*T rows, as a (1, r1 - r0, ...) view."""
    return x.reshape(1, -1, *x.shape[2:])[:, r0:r1]


def head_buffers(a, ops, B, T, C, V, dtype, products, logit_rows):
    """The head's buffers on a family's Activations a: the logits (B, T, V), or (1, logit_rows, V)
    with the chunked loss, overwritten in place by dlogits in the backward; with chunks, dhead
    (B, T, C), the d x a training forward may form (head_loss), which the family takes as its d x
    buffer; each row's loss and log-sum-exp. With bf16 products (the cpu's train.dtype bfloat16)
    the logits are bf16, as torch autocast's lm_head gives them (transformers then widens them for
    the loss, as the cross-entropy kernels do), and so is their gradient, the lm_head's backward
    products' input: half the bytes of float32 logits, which were kept beside a bf16 copy of dlogits."""
    a.chunked = logit_rows is not None
    lshape = (1, logit_rows, V) if a.chunked else (B, T, V)
    a.logits = ops.empty(lshape, products if np.dtype(products) == np.uint16 else dtype)
    a.dhead = ops.empty((B, T, C), dtype) if a.chunked else None
    a.losses = ops.empty((B, T), np.float32)
    a.lse = ops.empty((B, T), ops.LSE_DTYPE)  # cpu float64: see crossentropy_forward


class Head:
    """Mixed into models/family.py's FlatModel: the families call head_forward and head_backward
    where the whole path's linear and cross-entropy were; FlatModel.forward and forward_staged call
    head_logits and head_loss. The activations' `logits` is (1, loss_chunk, V) when chunked."""

    def head_forward(self, a, x, W, dW):
        """The logits x (B, T, C) @ W (C, V) into a.logits; with loss_chunk, nothing yet: head_loss
        and head_backward form them loss_chunk rows at a time (head_chunks). dW: W's gradient (its
        transposed view), None where W is frozen."""
        a.head, a.head_dx, a.head_dz = (x, W, dW), False, False
        if not a.chunked:
            self._logits(a.logits, x, W)

    def real(self, logits):
        """The first vocab_size columns of a logits buffer (itself where the vocabulary is not padded)."""
        V = self.config.vocab_size
        return logits if logits.shape[-1] == V else logits[..., :V]

    def _logits(self, out, x, W):
        """out = x @ W, softcapped in place where the family's config sets final_logit_softcapping
        (Gemma: cap tanh(z / cap); the cross-entropy's backward takes the cap back out)."""
        self.ops.linear_forward(out, x, W)
        if self.softcap:
            self.ops.softcap_forward(out, self.softcap)

    @property
    def softcap(self):
        return getattr(self.config, "final_logit_softcapping", 0.0)

    def head_loss(self, a, grad=False):
        """The mean loss over the non-ignored targets, as the backend's scalar; keeps each row's loss
        and log-sum-exp (and with chunks, dloss = 1/n for the backward). grad (a backward of the mean
        loss follows): whole, dlogits formed with the loss, over the logits (a.head_dz); chunked with W
        frozen, the hidden state's gradient too, into a.dhead (head_backward's)."""
        if not a.chunked:
            z = self.real(a.logits)
            a.head_dz = grad
            if grad:
                return self.ops.crossentropy_forward_backward(a.losses, a.lse, z, a.targets, **self._cap())
            return self.ops.crossentropy_forward(a.losses, a.lse, z, a.targets)
        x, W, dW = a.head
        a.head_dx = grad and dW is None
        if a.head_dx:  # dloss = 1/n depends on the targets alone: known before any loss
            a.dloss = self.ops.crossentropy_mean(a.losses, a.targets)[1]
        for r0, r1, logits in self.head_chunks(a):
            self._logits(logits, row_range(x, r0, r1), W)
            rows = (row_range(a.losses, r0, r1), row_range(a.lse, r0, r1), self.real(logits),
                    row_range(a.targets, r0, r1))
            if a.head_dx:  # the chunk's loss and its dlogits (the whole batch's 1/n) in one call, then its dx
                self.ops.crossentropy_forward_backward(*rows, a.dloss, **self._cap())
                self._chunk_products(a, r0, r1, logits, a.dhead, None, False)
            else:
                self.ops.crossentropy_forward(*rows)
        loss, a.dloss = self.ops.crossentropy_mean(a.losses, a.targets)
        return loss

    def head_logits(self, a):
        """The logits (B, T, V) as a new float32 NumPy array (forward without targets)."""
        if not a.chunked:
            return self._float32(self.real(a.logits), copy=True)
        out = np.empty((a.B * a.T, self.config.vocab_size), np.float32)
        x, W, _ = a.head
        for r0, r1, logits in self.head_chunks(a):
            self._logits(logits, row_range(x, r0, r1), W)
            out[r0:r1] = self._float32(self.real(logits))[0]
        return out.reshape(a.B, a.T, -1)

    def _float32(self, logits, copy=False):
        """The logits as float32 NumPy: bf16 ones (uint16: the cpu's bf16 training) widened into a new
        array (the backend's from_bf16), float32 ones as they are, or copied."""
        z = self.ops.to_numpy(logits)
        if z.dtype == np.uint16:
            return self.ops.from_bf16(z)
        return z.copy() if copy else z

    def head_backward(self, a, dx, acc, dloss=None):
        """d loss / d x into dx (B, T, C), and d loss / d W added to head_forward's dW (written when
        not acc; None: frozen), from the loss head_loss formed. dloss (B, T) (the backend's array):
        the gradient of another objective in each token's loss instead of the mean's 1/n
        (training/dpo.py's: each token of a sequence weighted by d loss / d its summed log-prob); the
        forward must then have left the head's gradient to the backward (grad=False).

        Whole: dlogits = (softmax(z) - onehot(y)) / n in place of the logits, then dx = dlogits @ W^T,
        dW (+)= x^T @ dlogits. Chunked, over the row ranges R of head_chunks: the rows are
        independent given lse (saved by the forward) and dloss = 1/n over every row (not a chunk's),
        so z_R = x_R @ W is formed again, dlogits_R = (exp(z_R - lse_R) - onehot(y_R)) * dloss,
        dx_R = dlogits_R @ W^T, and dW += x_R^T @ dlogits_R sums over R to x^T @ dlogits. Where
        head_loss formed dx already (the same kernels on the same z_R: the same bits), it is copied
        (or is dx itself: the families' dhead is their dx buffer). Softcapped logits z' = cap tanh(z / cap)
        (Gemma's final_logit_softcapping): the cross-entropy's backward reads z' and multiplies its
        gradient by dz'/dz = 1 - (z' / cap)^2 as it writes it, so dlogits is the uncapped logits'."""
        x, W, dW = a.head
        if dloss is not None and (a.head_dx or a.head_dz):
            raise RuntimeError("backward(dloss=...): the forward formed the mean loss's gradient already; "
                               "run it with grad=False")
        if not a.chunked:
            if not a.head_dz:  # else the forward's fused pass wrote dlogits already
                z = self.real(a.logits)
                self.ops.crossentropy_backward(z, z, a.lse, a.targets, dloss, **self._cap())  # in place
            self.ops.linear_backward(dx, dW, None, a.logits, x, W, acc)
        elif a.head_dx:
            if dx is not a.dhead:
                dx[...] = a.dhead
        else:
            for r0, r1, logits in self.head_chunks(a):
                self._logits(logits, row_range(x, r0, r1), W)
                self._chunk_backward(a, r0, r1, logits, dx, dW, acc or r0 > 0, dloss)

    def _chunk_backward(self, a, r0, r1, logits, dx, dW, acc, dloss=None):
        """Rows r0:r1 of dx, and their part of dW, from the chunk's logits z_R (overwritten by
        their gradient)."""
        scale = a.dloss if dloss is None else row_range(dloss, r0, r1)
        z = self.real(logits)
        self.ops.crossentropy_backward(z, z, row_range(a.lse, r0, r1), row_range(a.targets, r0, r1), scale,
                                       **self._cap())
        self._chunk_products(a, r0, r1, logits, dx, dW, acc)

    def _chunk_products(self, a, r0, r1, dlogits, dx, dW, acc):
        """Rows r0:r1 of dx, and their part of dW (None: frozen), from the chunk's dlogits."""
        self.ops.linear_backward(row_range(dx, r0, r1), dW, None, dlogits, row_range(a.head[0], r0, r1), a.head[1],
                                 acc)

    def _cap(self):
        """The cross-entropy backward's softcap keyword: only where the logits are capped."""
        return {"softcap": self.softcap} if self.softcap else {}

    @staticmethod
    def head_chunks(a):
        """(r0, r1, the logits buffer's first r1 - r0 rows) for each range of loss_chunk rows of B*T."""
        n, N = a.logits.shape[1], a.B * a.T
        for r0 in range(0, N, n):
            r1 = min(N, r0 + n)
            yield r0, r1, a.logits[:, :r1 - r0]
