# The durable KV tier: one S3 bucket holding per-chunk KV files under
# {kv_prefix}/{model_fp}/{key[:2]}/{key}.safetensors and built indexes under
# {index_prefix}/{version}/. This module knows nothing about EC2 or Batch; the
# serving and indexing modules get least-privilege access from its outputs.

data "aws_caller_identity" "current" {}
data "aws_partition" "current" {}

locals {
  bucket_name = var.bucket_name
  # bucket_prefix leaves room for the 26-character suffix Terraform appends.
  bucket_prefix = var.bucket_name == null ? "${var.name}-kv-" : null
}

resource "aws_kms_key" "kv" {
  description             = "${var.name}: SSE-KMS key for the KV-cache bucket"
  enable_key_rotation     = true
  deletion_window_in_days = var.kms_deletion_window_days

  # Administration stays with the account; use is granted by IAM policies
  # (serving instance profile, Batch job role) that name this key.
  policy = jsonencode({
    Version = "2012-10-17"
    Statement = [{
      Sid       = "AccountAdministersKey"
      Effect    = "Allow"
      Principal = { AWS = "arn:${data.aws_partition.current.partition}:iam::${data.aws_caller_identity.current.account_id}:root" }
      Action    = "kms:*"
      Resource  = "*"
    }]
  })

  tags = var.tags
}

resource "aws_kms_alias" "kv" {
  name          = "alias/${var.name}-kv"
  target_key_id = aws_kms_key.kv.key_id
}

resource "aws_s3_bucket" "kv" {
  #checkov:skip=CKV_AWS_144:The KV cache is derived data that the indexer can rebuild; cross-region replication would double storage cost for no durability need.
  #checkov:skip=CKV2_AWS_62:No consumer of object events exists; KV files are found by key, never by notification.
  #checkov:skip=CKV_AWS_18:Access logging is optional (var.access_log_bucket); a log bucket is account infrastructure this module should not create.
  bucket        = local.bucket_name
  bucket_prefix = local.bucket_prefix
  force_destroy = var.force_destroy

  tags = var.tags
}

resource "aws_s3_bucket_ownership_controls" "kv" {
  bucket = aws_s3_bucket.kv.id

  rule {
    object_ownership = "BucketOwnerEnforced"
  }
}

resource "aws_s3_bucket_public_access_block" "kv" {
  bucket = aws_s3_bucket.kv.id

  block_public_acls       = true
  block_public_policy     = true
  ignore_public_acls      = true
  restrict_public_buckets = true
}

resource "aws_s3_bucket_server_side_encryption_configuration" "kv" {
  bucket = aws_s3_bucket.kv.id

  rule {
    apply_server_side_encryption_by_default {
      sse_algorithm     = "aws:kms"
      kms_master_key_id = aws_kms_key.kv.arn
    }
    # One data key per bucket instead of one KMS call per object: KV reads are
    # small and frequent, and per-object KMS calls would throttle and cost.
    bucket_key_enabled = true
  }
}

resource "aws_s3_bucket_versioning" "kv" {
  bucket = aws_s3_bucket.kv.id

  versioning_configuration {
    status = "Enabled"
  }
}

resource "aws_s3_bucket_policy" "kv" {
  bucket = aws_s3_bucket.kv.id
  # The public access block must exist first, or a policy change can race it.
  depends_on = [aws_s3_bucket_public_access_block.kv]

  policy = jsonencode({
    Version = "2012-10-17"
    Statement = [
      {
        Sid       = "DenyInsecureTransport"
        Effect    = "Deny"
        Principal = "*"
        Action    = "s3:*"
        Resource  = [aws_s3_bucket.kv.arn, "${aws_s3_bucket.kv.arn}/*"]
        Condition = { Bool = { "aws:SecureTransport" = "false" } }
      },
      {
        Sid       = "DenyOutdatedTLS"
        Effect    = "Deny"
        Principal = "*"
        Action    = "s3:*"
        Resource  = [aws_s3_bucket.kv.arn, "${aws_s3_bucket.kv.arn}/*"]
        Condition = { NumericLessThan = { "s3:TlsVersion" = "1.2" } }
      },
    ]
  })
}

resource "aws_s3_bucket_lifecycle_configuration" "kv" {
  bucket = aws_s3_bucket.kv.id
  # Lifecycle rules that touch versions need versioning to be set first.
  depends_on = [aws_s3_bucket_versioning.kv]

  rule {
    id     = "abort-incomplete-multipart-uploads"
    status = "Enabled"

    filter {}

    abort_incomplete_multipart_upload {
      days_after_initiation = var.abort_incomplete_multipart_days
    }
  }

  # Intelligent-Tiering with its instant-access tiers only: no
  # aws_s3_bucket_intelligent_tiering_configuration opts into the Archive or
  # Deep Archive tiers, so a KV read never waits for a restore.
  rule {
    id     = "intelligent-tiering"
    status = "Enabled"

    filter {}

    transition {
      days          = 0
      storage_class = "INTELLIGENT_TIERING"
    }
  }

  rule {
    id     = "noncurrent-versions"
    status = "Enabled"

    filter {}

    noncurrent_version_expiration {
      noncurrent_days = var.noncurrent_version_days
    }

    expiration {
      expired_object_delete_marker = true
    }
  }

  dynamic "rule" {
    for_each = toset(var.expired_prefixes)

    content {
      id     = "expire-${replace(rule.value, "/", "-")}"
      status = "Enabled"

      filter {
        # The trailing slash keeps "kv/ab" from also expiring "kv/abc".
        prefix = "${rule.value}/"
      }

      expiration {
        days = var.expired_prefix_days
      }

      noncurrent_version_expiration {
        noncurrent_days = 1
      }
    }
  }
}

resource "aws_s3_bucket_logging" "kv" {
  count = var.access_log_bucket == null ? 0 : 1

  bucket        = aws_s3_bucket.kv.id
  target_bucket = var.access_log_bucket
  target_prefix = "s3-access/${aws_s3_bucket.kv.id}/"
}
