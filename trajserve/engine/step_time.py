"""A step's time as this engine runs it, fitted online from the steps it ran.

The simulator's cost model (sim/cost_model.py) prices a step from its work:
weights streamed once, each new token's products, each sequence's host work
and each query-key pair's attention (N_pair = c h + c (c + 1) / 2 for c new
tokens after h cached, inference-optimization 8.2.3; a decode's is its
context, whose KV it reads). Over the range an engine runs on one machine
that is linear in the step's shape,

    T_step = t_0 + t_tok * (new tokens) + t_seq * (sequences) + t_pair * N_pair

and here its four coefficients are fitted by least squares to the steps the
engine actually ran, each weighing half as much every HALF_LIFE_STEPS steps
(a machine gets busier, a model warms up). Deadline-aware admission
(engine/deadline.py) prices a request's completion with it.
"""
from __future__ import annotations

import numpy as np

HALF_LIFE_STEPS = 500
MIN_STEPS = 16  # fewer steps seen: no prediction (the fit would be a guess)
RIDGE = 1e-9    # keeps the normal equations solvable before every shape has varied


class StepTimeModel:
    def __init__(self) -> None:
        self._xtx = np.zeros((4, 4))
        self._xty = np.zeros(4)
        self._decay = 0.5 ** (1.0 / HALF_LIFE_STEPS)
        self.num_steps = 0
        self._coef: np.ndarray | None = None
        # The sequence counts seen: a fit that saw one batch size cannot tell
        # a step's fixed cost from a row's, and must not be extrapolated.
        self.batch_sizes: set[int] = set()

    def observe(self, tokens: int, seqs: int, pairs: int, seconds: float) -> None:
        """One step ran `tokens` new tokens of `seqs` sequences, `pairs`
        query-key pairs of attention in all, in `seconds`."""
        x = np.array([1.0, tokens, seqs, pairs])
        self._xtx *= self._decay
        self._xty *= self._decay
        self._xtx += np.outer(x, x)
        self._xty += x * seconds
        self.num_steps += 1
        self._coef = None
        self.batch_sizes.add(seqs)

    @property
    def ready(self) -> bool:
        return self.num_steps >= MIN_STEPS

    @property
    def coefficients(self) -> np.ndarray:
        """(t_0, t_tok, t_seq, t_pair) in seconds; none below zero (a noisy fit
        must not make more work look cheaper)."""
        if self._coef is None:
            scale = np.maximum(np.diag(self._xtx), 1.0)
            coef = np.linalg.solve(self._xtx + RIDGE * np.diag(scale), self._xty)
            self._coef = np.maximum(coef, 0.0)
        return self._coef

    def seconds(self, steps: float, tokens: float, seqs: float, pairs: float) -> float:
        """`steps` steps that run `tokens` new tokens, `seqs` sequence rows
        and `pairs` pairs between them (the model is linear: sums price the same)."""
        t0, tok, seq, pair = self.coefficients
        return float(t0 * steps + tok * tokens + seq * seqs + pair * pairs)
