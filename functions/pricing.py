"""AWS prices and performance assumptions behind ``shardfold plan``'s cost estimate, in one place.

Prices are on-demand list prices for us-east-1, as published on the pages cited beside each constant (Lambda
by the deployed architecture: ``arm64`` unless ``shardfold:lambdaArchitecture`` says ``x86_64``);
free tiers are ignored, so the estimate is an upper bound for small accounts. Performance figures are
assumptions for the duration model, not measurements: ``bench/`` measures the real numbers.
"""

from __future__ import annotations

# --- prices (USD) -------------------------------------------------------------------------------------------

# https://aws.amazon.com/lambda/pricing/ : first 6 billion GB-s per month, per architecture (Arm is 20 % less)
LAMBDA_USD_PER_GB_S_BY_ARCH = {"x86_64": 0.0000166667, "arm64": 0.0000133334}
# What the stack deploys unless shardfold:lambdaArchitecture says otherwise (infra.config)
DEFAULT_LAMBDA_ARCHITECTURE = "arm64"
LAMBDA_USD_PER_GB_S = LAMBDA_USD_PER_GB_S_BY_ARCH[DEFAULT_LAMBDA_ARCHITECTURE]
# https://aws.amazon.com/lambda/pricing/ : $0.20 per 1M requests
LAMBDA_USD_PER_REQUEST = 0.20 / 1_000_000
# https://aws.amazon.com/step-functions/pricing/ : Standard workflows, $0.025 per 1,000 state transitions
SFN_USD_PER_TRANSITION = 0.025 / 1_000
# https://aws.amazon.com/s3/pricing/ : S3 Standard, GET/SELECT/other $0.0004 per 1,000 requests
S3_USD_PER_GET = 0.0004 / 1_000
# https://aws.amazon.com/s3/pricing/ : S3 Standard, PUT/COPY/POST/LIST $0.005 per 1,000 requests
S3_USD_PER_PUT = 0.005 / 1_000
# https://aws.amazon.com/s3/pricing/ : S3 Standard storage, first 50 TB, $0.023 per GB-month
S3_USD_PER_GB_MONTH = 0.023

# https://aws.amazon.com/ec2/pricing/on-demand/ : g5.xlarge (1x NVIDIA A10G, 4 vCPU, 16 GiB), Linux,
# us-east-1.
# The GPU stages' AWS Batch jobs run on such an instance; the default compute environment uses Spot, which
# is usually well below this on-demand price, so the estimate is an upper bound.
BATCH_GPU_USD_PER_HOUR = 1.006
# Instance launch plus container image pull before a Batch job's command runs (assumed); EC2 bills it.
BATCH_STARTUP_S = 180.0

# Lambda bills duration rounded up to the millisecond; we round each task up to this many seconds.
LAMBDA_MIN_BILLED_S = 0.001

# --- assumptions for the duration model ---------------------------------------------------------------------

# Median first-byte latency of a small S3 GET: "tens of milliseconds" (AWS whitepaper "Optimizing
# performance: timeouts and retries", see shared/reference/getbatch.md section 3).
S3_GET_LATENCY_S = 0.030
# Throughput of one Lambda function's network link to S3 in the same region; assumed, about 85-90 MB/s per
# connection per the S3 performance guide, a few connections saturate a function.
LAMBDA_NET_BYTES_PER_S = 300 * 1024 * 1024
# Resident memory of a warm Python 3.11 Lambda with boto3, pydantic and Powertools loaded (assumed).
LAMBDA_BASELINE_MB = 120
# Cold-start-plus-invoke overhead per task (assumed).
TASK_OVERHEAD_S = 0.25
# Ranged-GET throughput of one fedavg aggregate function reading N clients' shards: the GradsSharding paper
# measured 45-57 MB/s per Lambda function (shared/reference/gradsharding.md); its low end, so the plan
# errs toward more, smaller shards.
FEDAVG_READ_BYTES_PER_S = 45e6
# Server-side copy (UploadPartCopy) throughput of one request; assumed, no published figure: S3 copies
# inside the region, so it is not bound by the function's link.
S3_COPY_BYTES_PER_S = 200 * 1024 * 1024

# Every number above, with its unit and where it comes from (``shardfold plan --explain`` prints them).
MODEL = [
    ("Lambda GB-s (arm64)", LAMBDA_USD_PER_GB_S_BY_ARCH["arm64"], "USD", "aws.amazon.com/lambda/pricing"),
    ("Lambda GB-s (x86_64)", LAMBDA_USD_PER_GB_S_BY_ARCH["x86_64"], "USD", "aws.amazon.com/lambda/pricing"),
    ("Lambda request", LAMBDA_USD_PER_REQUEST, "USD", "aws.amazon.com/lambda/pricing"),
    ("Step Functions transition", SFN_USD_PER_TRANSITION, "USD", "aws.amazon.com/step-functions/pricing"),
    ("S3 GET", S3_USD_PER_GET, "USD", "aws.amazon.com/s3/pricing"),
    ("S3 PUT/COPY/LIST", S3_USD_PER_PUT, "USD", "aws.amazon.com/s3/pricing"),
    ("S3 storage GB-month", S3_USD_PER_GB_MONTH, "USD", "aws.amazon.com/s3/pricing"),
    ("GPU instance hour (g5.xlarge)", BATCH_GPU_USD_PER_HOUR, "USD", "aws.amazon.com/ec2/pricing/on-demand"),
    ("Batch job start-up", BATCH_STARTUP_S, "s", "assumed: instance launch and image pull"),
    ("S3 first byte", S3_GET_LATENCY_S, "s", "AWS whitepaper: tens of ms (shared/reference/getbatch.md)"),
    ("Lambda link to S3", LAMBDA_NET_BYTES_PER_S, "B/s", "assumed from the S3 performance guide"),
    ("fedavg aggregate read", FEDAVG_READ_BYTES_PER_S, "B/s", "GradsSharding paper: 45-57 MB/s measured"),
    ("S3 server-side copy", S3_COPY_BYTES_PER_S, "B/s", "assumed"),
    ("Lambda runtime memory", LAMBDA_BASELINE_MB, "MiB", "assumed; tests/test_memory.py measures tasks"),
    ("task overhead", TASK_OVERHEAD_S, "s", "assumed: cold start and invoke"),
]


def lambda_usd_per_gb_s(architecture: str | None) -> float:
    """The Lambda duration price of ``architecture`` (the deployed one; None: the stack's default)."""
    return LAMBDA_USD_PER_GB_S_BY_ARCH[architecture or DEFAULT_LAMBDA_ARCHITECTURE]
