"""One FedAvg round: three clients' updates written with client.fedavg, averaged by a `fedavg` job.

Run from anywhere: python examples/fedavg_average.py
The updates are generated here (numpy arrays; a torch state_dict works the same), so nothing is read from
the network. The job's output is checked against numpy's weighted mean.
"""

from __future__ import annotations

import os
import tempfile

import numpy as np

# A throwaway store unless you chose one (set before the Client is made: it reads it once).
if not os.environ.get("SHARDFOLD_HOME"):
    os.environ["SHARDFOLD_HOME"] = tempfile.mkdtemp(prefix="shardfold-example-")

from shardfold.client import Client  # noqa: E402  (after SHARDFOLD_HOME is settled)

# Examples each client trained on: FedAvg weights a client's update by it.
NUM_EXAMPLES = [120, 80, 200]


def client_update(rng: np.random.Generator) -> dict[str, np.ndarray]:
    """A tiny model's state: what a client sends back after its local training."""
    return {
        "encoder.weight": rng.standard_normal((8, 4)).astype(np.float32),
        "encoder.bias": rng.standard_normal(8).astype(np.float32),
        "head.weight": rng.standard_normal((2, 8)).astype(np.float32),
    }


def main() -> None:
    rng = np.random.default_rng(7)
    updates = [client_update(rng) for _ in NUM_EXAMPLES]

    with Client() as client:
        print(f"store: {client.store_root}")

        # Keys relative to the store root, as a spec would name them. num_examples goes into the file's
        # __metadata__, so the job needs no weights in its spec.
        keys = []
        for i, (update, n) in enumerate(zip(updates, NUM_EXAMPLES, strict=True)):
            key = f"rounds/1/clients/{i}.safetensors"
            client.fedavg.save_update(update, key, num_examples=n)
            keys.append(key)
            stored = client.fedavg.metadata(key)["num_examples"]  # read back from the file's header
            print(f"client {i}: {len(update)} tensors, num_examples={stored}")

        # accumulate="float64": the default float32 accumulators round at each step; in float64 the job's
        # mean is numpy's float64 weighted mean rounded once to float32, which the check below relies on.
        result = client.fedavg.run(keys, accumulate="float64")
        print(f"job {result['job_id']}: {result['clients']} clients, total weight {result['total_weight']:g}")
        print(f"averaged model: {result['output']}")

        averaged = client.fedavg.load(result["output"])  # dict of numpy arrays; framework="torch" for tensors
        print(f"output metadata: {client.fedavg.metadata(result['output'])}")

    # The same formula in plain numpy, rounded to the tensors' dtype: the job's output is bit-identical.
    for name, value in sorted(averaged.items()):
        expected = np.average(np.stack([u[name] for u in updates]), axis=0, weights=NUM_EXAMPLES)
        expected = expected.astype(value.dtype)
        assert np.array_equal(value, expected), f"{name}: the job's mean differs from numpy's"
        print(
            f"  {name:15} {str(value.shape):8} {value.dtype}  first values {np.round(value.ravel()[:3], 4)}"
        )
    print("matches numpy's weighted mean bit for bit")


if __name__ == "__main__":
    main()
