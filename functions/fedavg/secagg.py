"""Secure aggregation's arithmetic, shared by the clients (``client.fedavg.mask_update``) and the job.

A client's float update x is clipped to [−c, c] (``clip_range``), scaled by T/c and rounded stochastically
(unbiased) to an integer q ∈ [−T, T], stored mod 2³² as uint32, and masked with pairwise masks that cancel
in the sum (Bonawitz et al. 2017): y_u = q_u + Σ_{v>u} PRG(k_uv) − Σ_{v<u} PRG(k_uv) mod 2³², one key k_uv
per pair of clients (agreed by X25519 key exchange, client side). One masked update is uniform mod 2³²; the
job only ever sums them, exactly, in uint32 (wrapping is the mod), and dequantises the sum:

    mean = int32(Σ_u y_u) · c / (T · N)

exact as long as |Σ q_u| < 2³¹: T = ⌊(2³¹ − 1)/N⌋ (:func:`scale`) for N clients guarantees it. The
quantisation step is c/T, so the mean's error is at most c/T per coordinate after clipping (its rounding is
unbiased). Every client of the round must send its masked update: a missing one leaves its masks in the
sum (recovering them from secret-shared seeds is not implemented).

Nothing here imports a cryptography library: the keys and the mask streams are the client's
(:mod:`client.secagg`); the job needs only :func:`scale` and :func:`dequantise`.
"""

from __future__ import annotations

import json
from dataclasses import dataclass

import numpy as np

METADATA_KEY = "shardfold_secagg"  # __metadata__ of a masked update: its round's parameters, as JSON
VERSION = 1


def scale(clients: int) -> int:
    """T: the largest quantisation scale whose sum over ``clients`` cannot leave int32."""
    if clients < 1:
        raise ValueError(f"a secure round needs at least one client, got {clients}")
    return (2**31 - 1) // clients


@dataclass(frozen=True)
class RoundParams:
    """What every masked update of a round records and must agree on: the round's id, how many clients mask
    with each other, the clip range c, the scale T and each tensor's dtype before quantisation."""

    round: str
    clients: int
    clip_range: float
    scale: int
    dtypes: dict[str, str]
    version: int = VERSION

    def to_json(self) -> str:
        return json.dumps(
            {
                "version": self.version,
                "round": self.round,
                "clients": self.clients,
                "clip_range": self.clip_range,
                "scale": self.scale,
                "dtypes": dict(sorted(self.dtypes.items())),
            },
            sort_keys=True,
        )

    @classmethod
    def from_json(cls, text: str) -> RoundParams:
        doc = json.loads(text)
        if not isinstance(doc, dict) or doc.get("version") != VERSION:
            raise ValueError(f"{METADATA_KEY} is not version {VERSION} secure-aggregation metadata")
        params = cls(
            round=str(doc["round"]),
            clients=int(doc["clients"]),
            clip_range=float(doc["clip_range"]),
            scale=int(doc["scale"]),
            dtypes={str(k): str(v) for k, v in doc["dtypes"].items()},
        )
        if params.clients < 1 or params.scale != scale(params.clients) or not params.clip_range > 0:
            raise ValueError(f"{METADATA_KEY}: inconsistent clients, scale or clip_range")
        return params


def quantise(x: np.ndarray, clip_range: float, t: int, rng: np.random.Generator) -> np.ndarray:
    """x clipped to [−c, c], times T/c, rounded stochastically (unbiased) to an integer, as uint32 mod 2³²."""
    v = np.clip(np.asarray(x, dtype=np.float64), -clip_range, clip_range) * (t / clip_range)
    np.clip(v, -t, t, out=v)  # the product may round past T, and T + 1 would overflow for one client
    low = np.floor(v)
    q = low + (rng.random(v.shape) < (v - low))
    return q.astype(np.int64).astype(np.uint32)  # two's complement: mod 2³²


def dequantise(total: np.ndarray, params: RoundParams, clients: int) -> np.ndarray:
    """The mean of ``clients`` updates from the uint32 sum of their masked (or plain) quantised values."""
    signed = np.asarray(total, dtype=np.uint32).view(np.int32).astype(np.float64)
    return signed * (params.clip_range / (params.scale * clients))
