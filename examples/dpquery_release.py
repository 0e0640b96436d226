"""A differentially private release of marginals, with error bars and the dataset's budget ledger.

Run from anywhere: python examples/dpquery_release.py
Uses events/dpquery.json over events/data/dpquery/people.csv (2,000 synthetic rows): five marginals at
epsilon = 1 (delta = 1e-6) out of a total budget of rho = 1 for the dataset "example-people".
"""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
SPEC = REPO / "events" / "dpquery.json"

# Every run spends privacy budget on the store's ledger of "example-people", and budgets never grow back:
# so, unless you chose a store, run on a fresh one and leave yours untouched.
if not os.environ.get("SHARDFOLD_HOME"):
    os.environ["SHARDFOLD_HOME"] = tempfile.mkdtemp(prefix="shardfold-example-")

from shardfold.client import Client  # noqa: E402  (after SHARDFOLD_HOME is settled)


def main() -> None:
    with Client() as client:
        print(f"store (and its budget ledger): {client.store_root}")

        # The plan comes from the spec alone: noise, predicted error and privacy are known before any data
        # is read, so a release can be tuned without spending anything.
        plan = client.dpquery.plan(SPEC)
        privacy = plan.privacy_report()
        eps, delta, exact = privacy["epsilon_cks"], privacy["delta"], privacy["epsilon_gaussian"]
        print(
            f"plan: rho={privacy['rho']:.4f}, epsilon={eps:.2f} at delta={delta:g}"
            f" (exact Gaussian curve: {exact:.2f}), predicted RMSE {plan.rmse:.1f}"
        )
        for name, predicted in client.dpquery.predicted(SPEC).items():
            std_error, cells = predicted["std_error"], predicted["cells"]
            print(f"  predicted std error of {name:20} {std_error:6.2f} ({cells} cells)")

        # A Path, so the spec's "./data/..." dataset resolves relative to the spec file.
        result = client.dpquery.run(SPEC)
        print(f"job {result['job_id']}: spent rho={result['report']['rho_spent']:.4f}")
        print(f"tables under: {result['output']}")

        # Marginals are named by their attributes in schema order ("sex,region"); any order finds them.
        table = client.dpquery.tables(result, ["region, sex"])["sex,region"]
        print("released counts by sex and region (noisy; 95% interval = estimate +- 1.96 std_error):")
        for row in table.to_pylist():
            estimate, std_error = row["estimate"], row["std_error"]
            low, high = estimate - 1.96 * std_error, estimate + 1.96 * std_error
            print(
                f"  {row['sex']:6} {row['region']:6} {estimate:7.1f}"
                f"  std_error {std_error:5.2f}  [{low:6.1f}, {high:6.1f}]"
            )
        values, _ = client.dpquery.arrays(result, ["(total)"])["(total)"]  # the total: a 0-d array
        std_errors = client.dpquery.std_errors(result)
        print(f"total count: {float(values):.1f} +- {std_errors['(total)']:.1f} (std error)")

        # Any count in a box of the schema, from the same release (no more budget): here a range of ages
        # and three education levels, summed from the [age, education] marginal with its exact error.
        box = {"age": (18, 47), "education": ["bachelor", "master", "doctorate"]}
        graduates = client.dpquery.answer(result, box)
        print(
            f"graduates aged 18-47: {graduates['estimate']:.1f} +- {graduates['std_error']:.1f} (std error)"
        )

        # The ledger counts every job's spend against the dataset's total; a job that would overspend it
        # is refused before anything is measured.
        budget = client.dpquery.budget("example-people")
        print(
            f"ledger of {budget['dataset_id']}: total rho {budget['total']:g}, spent {budget['spent']:.4f}, "
            f"remaining {budget['remaining']:.4f} ({len(budget['jobs'])} job(s))"
        )


if __name__ == "__main__":
    main()
