# Plan-level checks of the KV bucket module, offline (mock AWS provider).

mock_provider "aws" {
  mock_data "aws_partition" {
    defaults = { partition = "aws" }
  }
  mock_data "aws_caller_identity" {
    defaults = { account_id = "123456789012" }
  }
}

variables {
  name             = "ragkv-test"
  expired_prefixes = ["kv/0ldf1ngerprint", "index/v1"]
  tags             = { Project = "ragkv", Team = "infra" }
}

run "encryption_is_sse_kms_with_bucket_key" {
  command = plan

  module {
    source = "./modules/kv-bucket"
  }

  assert {
    condition     = alltrue([for r in aws_s3_bucket_server_side_encryption_configuration.kv.rule : r.apply_server_side_encryption_by_default[0].sse_algorithm == "aws:kms"])
    error_message = "The KV bucket must be encrypted with SSE-KMS."
  }

  assert {
    condition     = alltrue([for r in aws_s3_bucket_server_side_encryption_configuration.kv.rule : r.bucket_key_enabled == true])
    error_message = "The S3 bucket key must be on (one KMS call per bucket, not per object)."
  }

  assert {
    condition     = aws_kms_key.kv.enable_key_rotation == true
    error_message = "KMS key rotation must be on."
  }
}

run "public_access_is_blocked_four_ways" {
  command = plan

  module {
    source = "./modules/kv-bucket"
  }

  assert {
    condition = alltrue([
      aws_s3_bucket_public_access_block.kv.block_public_acls,
      aws_s3_bucket_public_access_block.kv.block_public_policy,
      aws_s3_bucket_public_access_block.kv.ignore_public_acls,
      aws_s3_bucket_public_access_block.kv.restrict_public_buckets,
    ])
    error_message = "All four public access blocks must be on."
  }

  assert {
    condition     = one(aws_s3_bucket_ownership_controls.kv.rule).object_ownership == "BucketOwnerEnforced"
    error_message = "ACLs must be disabled (BucketOwnerEnforced)."
  }
}

run "lifecycle_aborts_uploads_and_expires_old_versions_by_prefix" {
  command = plan

  module {
    source = "./modules/kv-bucket"
  }

  assert {
    condition = anytrue([
      for r in aws_s3_bucket_lifecycle_configuration.kv.rule :
      try(r.abort_incomplete_multipart_upload[0].days_after_initiation, 0) == 1
    ])
    error_message = "Incomplete multipart uploads must be aborted after a day."
  }

  assert {
    condition = toset([
      for r in aws_s3_bucket_lifecycle_configuration.kv.rule : r.filter[0].prefix if startswith(r.id, "expire-")
    ]) == toset(["kv/0ldf1ngerprint/", "index/v1/"])
    error_message = "Each expired prefix (and only those) must get an expiration rule filtered on '<prefix>/'."
  }

  assert {
    condition = alltrue([
      for r in aws_s3_bucket_lifecycle_configuration.kv.rule : r.expiration[0].days == 1 if startswith(r.id, "expire-")
    ])
    error_message = "Objects under an expired prefix must expire after expired_prefix_days (1)."
  }

  assert {
    condition = alltrue(flatten([
      for r in aws_s3_bucket_lifecycle_configuration.kv.rule : [for t in r.transition : t.storage_class == "INTELLIGENT_TIERING"]
    ]))
    error_message = "Objects may only transition to INTELLIGENT_TIERING (no Glacier class a read would wait on)."
  }

  assert {
    condition = anytrue(flatten([
      for r in aws_s3_bucket_lifecycle_configuration.kv.rule : [for t in r.transition : t.storage_class == "INTELLIGENT_TIERING" && t.days == 0]
    ]))
    error_message = "Objects must enter Intelligent-Tiering at once."
  }
}

run "bucket_policy_denies_plain_http" {
  command = plan

  module {
    source = "./modules/kv-bucket"
  }

  override_resource {
    target          = aws_s3_bucket.kv
    override_during = plan
    values          = { arn = "arn:aws:s3:::ragkv-test-kv", id = "ragkv-test-kv" }
  }

  assert {
    condition = anytrue([
      for s in jsondecode(aws_s3_bucket_policy.kv.policy).Statement :
      s.Effect == "Deny" && try(s.Condition.Bool["aws:SecureTransport"], "") == "false"
    ])
    error_message = "The bucket policy must deny requests without TLS."
  }

  assert {
    condition     = output.kv_s3_uri == "s3://ragkv-test-kv/kv"
    error_message = "kv_s3_uri must be s3://{bucket}/{kv_prefix}."
  }
}

run "empty_expired_prefix_is_refused" {
  command = plan

  module {
    source = "./modules/kv-bucket"
  }

  variables {
    expired_prefixes = [""]
  }

  expect_failures = [var.expired_prefixes]
}
