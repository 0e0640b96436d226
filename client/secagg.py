"""The client's side of secure aggregation: key agreement and the pairwise masks (Bonawitz et al. 2017).

Each client of a round makes an X25519 key pair and publishes its public key in the store
(``<round>/keys/<client id>.pub``); once every client has, each derives one key per other client,
``k_uv = HKDF-SHA256(X25519(sk_u, pk_v), info = "shardfold-secagg/v1" ‖ round ‖ min(u, v) ‖ max(u, v))``,
expands it with ChaCha20 into a stream of uint32 words (the PRG: a fresh key per pair and round, so the
zero nonce is never reused under one key) and adds the streams of the clients after it and subtracts
those before it, mod 2³², over its quantised update (:mod:`functions.fedavg.secagg`). The masks cancel in
the sum of every client's masked update; one masked update alone is uniform mod 2³².

The threat model is the first step of Bonawitz et al.'s: the server (whoever runs the job and reads the
bucket) follows the protocol but is curious; it does not substitute public keys (an active server could:
the keys are not authenticated), and every client that published a key must send its masked update.
"""

from __future__ import annotations

from collections.abc import Mapping

import numpy as np
from cryptography.hazmat.primitives import hashes
from cryptography.hazmat.primitives.asymmetric.x25519 import X25519PrivateKey, X25519PublicKey
from cryptography.hazmat.primitives.ciphers import Cipher, algorithms
from cryptography.hazmat.primitives.kdf.hkdf import HKDF

INFO = b"shardfold-secagg/v1"
KEY_BYTES = 32
_ZERO_NONCE = bytes(16)  # ChaCha20's 4-byte counter and 12-byte nonce: one stream per (fresh) key


def new_private_key() -> bytes:
    """A fresh X25519 private key (32 bytes): the client keeps it until it has masked its update."""
    return X25519PrivateKey.generate().private_bytes_raw()


def public_key(private: bytes) -> bytes:
    return X25519PrivateKey.from_private_bytes(private).public_key().public_bytes_raw()


def pair_key(private: bytes, peer_public: bytes, round_id: str, me: str, peer: str) -> bytes:
    """k_uv: the key ``me`` and ``peer`` both derive for this round (symmetric in the two ids)."""
    shared = X25519PrivateKey.from_private_bytes(private).exchange(
        X25519PublicKey.from_public_bytes(peer_public)
    )
    first, second = sorted((me, peer))
    info = b"\0".join([INFO, round_id.encode(), first.encode(), second.encode()])
    return HKDF(algorithm=hashes.SHA256(), length=KEY_BYTES, salt=None, info=info).derive(shared)


def mask_stream(key: bytes, words: int) -> np.ndarray:
    """``words`` uint32 words of ChaCha20's keystream under ``key``."""
    encryptor = Cipher(algorithms.ChaCha20(key, _ZERO_NONCE), mode=None).encryptor()
    return np.frombuffer(encryptor.update(bytes(4 * words)), dtype="<u4")  # read-only: added, never written


def mask(
    quantised: np.ndarray, private: bytes, me: str, peers: Mapping[str, bytes], round_id: str
) -> np.ndarray:
    """``quantised`` (uint32, flat) plus the masks shared with every peer (``peers``: id -> public key,
    ``me`` excluded): + PRG(k_uv) for each peer v after ``me`` in id order, − for each before, mod 2³²."""
    out = np.array(quantised, dtype=np.uint32, copy=True)
    for peer, public in sorted(peers.items()):
        if peer == me:
            continue
        stream = mask_stream(pair_key(private, public, round_id, me, peer), out.size)
        if peer > me:
            np.add(out, stream, out=out)
        else:
            np.subtract(out, stream, out=out)
    return out
