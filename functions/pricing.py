"""AWS prices and performance assumptions behind ``shardfold plan``'s cost estimate, in one place.

Prices are on-demand list prices for us-east-1 (x86), as published on the pages cited beside each constant;
free tiers are ignored, so the estimate is an upper bound for small accounts. Performance figures are
assumptions for the duration model, not measurements: ``bench/`` measures the real numbers.
"""

from __future__ import annotations

# --- prices (USD) -------------------------------------------------------------------------------------------

# https://aws.amazon.com/lambda/pricing/ : x86, first 6 billion GB-s per month
LAMBDA_USD_PER_GB_S = 0.0000166667
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
