# Batch indexing on Spot GPUs: a SPOT compute environment across several GPU
# instance types, one job queue, and two job definitions: `ragkv index` (an
# array job, one child per shard) and `ragkv index merge`, submitted with a
# dependency on the array job. A reclaimed host or the indexer's own
# interruption exit code (after it has checkpointed) is retried; any other
# failure is final, so a bug is not paid for five times.

data "aws_partition" "current" {}
data "aws_region" "current" {}
data "aws_caller_identity" "current" {}

locals {
  partition = data.aws_partition.current.partition

  corpus_s3_uri = coalesce(var.corpus_s3_uri, "s3://${var.kv_bucket_name}/corpus")
  corpus_parts  = regex("^s3://([^/]+)/?(.*)$", local.corpus_s3_uri)
  corpus_bucket = local.corpus_parts[0]
  corpus_prefix = trimsuffix(local.corpus_parts[1], "/")
  corpus_keys   = local.corpus_prefix == "" ? "*" : "${local.corpus_prefix}/*"

  kv_s3_uri     = "s3://${var.kv_bucket_name}/${var.kv_prefix}"
  index_out_uri = "s3://${var.kv_bucket_name}/${var.index_prefix}/${var.index_version}"

  job_environment = [
    for k, v in merge({
      AWS_REGION      = data.aws_region.current.name
      RAGKV_KV_S3_URI = local.kv_s3_uri
      CORPUS_URI      = local.corpus_s3_uri
      INDEX_OUT_URI   = local.index_out_uri
      SHARD_COUNT     = tostring(var.shard_count)
    }, var.environment) : { name = k, value = v }
  ]

  # First match wins. A host reclaimed under the job ("Host EC2 (instance
  # i-...) terminated.") and the indexer's checkpoint-and-exit code retry;
  # every other exit is final.
  retry_rules = [
    { on_status_reason = "Host EC2*", on_exit_code = null, on_reason = null, action = "RETRY" },
    { on_status_reason = null, on_exit_code = tostring(var.interruption_exit_code), on_reason = null, action = "RETRY" },
    { on_status_reason = null, on_exit_code = "*", on_reason = null, action = "EXIT" },
    { on_status_reason = null, on_exit_code = null, on_reason = "*", action = "EXIT" },
  ]

  # Batch launch templates take MIME multi-part user data. Spot draining stops
  # the ECS agent from placing new jobs on an instance that has received the
  # two-minute notice and stops the running job: the indexer gets SIGTERM (the
  # container cannot reach IMDS, hop limit 1), checkpoints within
  # ECS_CONTAINER_STOP_TIMEOUT, and exits with the interruption code.
  batch_user_data = <<-EOT
    MIME-Version: 1.0
    Content-Type: multipart/mixed; boundary="==RAGKV=="

    --==RAGKV==
    Content-Type: text/x-shellscript; charset="us-ascii"

    #!/bin/bash
    cat >> /etc/ecs/ecs.config <<'CFG'
    ECS_ENABLE_SPOT_INSTANCE_DRAINING=true
    ECS_CONTAINER_STOP_TIMEOUT=${var.stop_timeout_seconds}s
    CFG

    --==RAGKV==--
  EOT
}

# --- IAM ---

resource "aws_iam_role" "instance" {
  name_prefix = "${var.name}-batch-ec2-"
  description = "ECS container instances of the ragkv indexing compute environment"

  assume_role_policy = jsonencode({
    Version = "2012-10-17"
    Statement = [{
      Effect    = "Allow"
      Principal = { Service = "ec2.amazonaws.com" }
      Action    = "sts:AssumeRole"
    }]
  })

  tags = var.tags
}

resource "aws_iam_role_policy_attachment" "instance_ecs" {
  role       = aws_iam_role.instance.name
  policy_arn = "arn:${local.partition}:iam::aws:policy/service-role/AmazonEC2ContainerServiceforEC2Role"
}

# Session Manager without AmazonSSMManagedInstanceCore (which may read every SSM
# parameter of the account): the agent's registration and its session channels only.
resource "aws_iam_role_policy" "instance_ssm" {
  count = var.enable_ssm ? 1 : 0

  name = "ragkv-session-manager"
  role = aws_iam_role.instance.id

  policy = jsonencode({
    Version = "2012-10-17"
    Statement = [
      {
        # The agent registers its own instance.
        Sid      = "SessionManagerRegister"
        Effect   = "Allow"
        Action   = ["ssm:UpdateInstanceInformation"]
        Resource = "arn:${local.partition}:ec2:${data.aws_region.current.name}:${data.aws_caller_identity.current.account_id}:instance/*"
      },
      {
        # Session channels and agent messages: these actions take no resource but "*".
        Sid    = "SessionManagerChannels"
        Effect = "Allow"
        Action = [
          "ssmmessages:CreateControlChannel", "ssmmessages:CreateDataChannel",
          "ssmmessages:OpenControlChannel", "ssmmessages:OpenDataChannel",
          "ec2messages:AcknowledgeMessage", "ec2messages:DeleteMessage", "ec2messages:FailMessage",
          "ec2messages:GetEndpoint", "ec2messages:GetMessages", "ec2messages:SendReply",
        ]
        Resource = "*"
      },
    ]
  })
}

resource "aws_iam_instance_profile" "instance" {
  name_prefix = "${var.name}-batch-ec2-"
  role        = aws_iam_role.instance.name

  tags = var.tags
}

# The job's own credentials (ECS task role): the instance role above can pull
# images and talk to ECS but cannot touch the data.
resource "aws_iam_role" "job" {
  name_prefix = "${var.name}-index-job-"
  description = "ragkv indexing jobs: read the corpus, write KV and index"

  assume_role_policy = jsonencode({
    Version = "2012-10-17"
    Statement = [{
      Effect    = "Allow"
      Principal = { Service = "ecs-tasks.amazonaws.com" }
      Action    = "sts:AssumeRole"
    }]
  })

  tags = var.tags
}

resource "aws_iam_role_policy" "job" {
  name = "ragkv-index-data"
  role = aws_iam_role.job.id

  policy = jsonencode({
    Version = "2012-10-17"
    Statement = concat(
      [
        {
          Sid      = "ReadCorpus"
          Effect   = "Allow"
          Action   = ["s3:GetObject"]
          Resource = "arn:${local.partition}:s3:::${local.corpus_bucket}/${local.corpus_keys}"
        },
        {
          Sid      = "ListCorpus"
          Effect   = "Allow"
          Action   = ["s3:ListBucket"]
          Resource = "arn:${local.partition}:s3:::${local.corpus_bucket}"
          Condition = {
            StringLike = { "s3:prefix" = [local.corpus_keys] }
          }
        },
        {
          # its own index version only: a job (which parses untrusted documents) never rewrites
          # another version, the one the serving tier runs included
          Sid      = "ReadWriteKVAndIndex"
          Effect   = "Allow"
          Action   = ["s3:GetObject", "s3:PutObject", "s3:AbortMultipartUpload"]
          Resource = ["${var.kv_bucket_arn}/${var.kv_prefix}/*", "${var.kv_bucket_arn}/${var.index_prefix}/${var.index_version}/*"]
        },
        {
          # The S3 tier deletes an object that fails verification, so a later put can replace it.
          Sid      = "DeleteBadKV"
          Effect   = "Allow"
          Action   = ["s3:DeleteObject"]
          Resource = "${var.kv_bucket_arn}/${var.kv_prefix}/*"
        },
        {
          # Unconditional: without s3:ListBucket S3 answers a missing key with 403,
          # not 404, and every KV miss would be logged and counted as an error.
          Sid      = "ListKVBucket"
          Effect   = "Allow"
          Action   = ["s3:ListBucket"]
          Resource = var.kv_bucket_arn
        },
        {
          Sid      = "UseBucketKey"
          Effect   = "Allow"
          Action   = ["kms:Decrypt", "kms:GenerateDataKey"]
          Resource = var.kms_key_arn
        },
      ],
      var.corpus_kms_key_arn == null ? [] : [{
        Sid      = "DecryptCorpus"
        Effect   = "Allow"
        Action   = ["kms:Decrypt"]
        Resource = var.corpus_kms_key_arn
      }],
    )
  })
}

# --- Network: no ingress at all; egress only for HTTP(S) ---

resource "aws_security_group" "batch" {
  name_prefix = "${var.name}-batch-"
  description = "ragkv indexing instances: no ingress, HTTP(S) egress only"
  vpc_id      = var.vpc_id

  tags = merge(var.tags, { Name = "${var.name}-batch" })

  lifecycle {
    create_before_destroy = true
  }
}

resource "aws_vpc_security_group_egress_rule" "batch" {
  for_each = { http = 80, https = 443 }

  security_group_id = aws_security_group.batch.id
  description       = "${upper(each.key)} to ECR, S3, ECS and package mirrors"
  ip_protocol       = "tcp"
  from_port         = each.value
  to_port           = each.value
  cidr_ipv4         = "0.0.0.0/0"

  tags = var.tags
}

# --- Compute ---

resource "aws_launch_template" "batch" {
  name_prefix            = "${var.name}-batch-"
  description            = "ragkv indexing Spot instances: IMDSv2, encrypted root, Spot draining"
  user_data              = base64encode(local.batch_user_data)
  update_default_version = true

  metadata_options {
    http_endpoint = "enabled"
    http_tokens   = "required"
    # 1 hop: a job's container (one hop further, bridge network) cannot reach IMDS, so
    # never the instance role's credentials; its own are the job role's (ECS task role).
    # The Spot notice reaches the indexer as SIGTERM from the ECS agent's draining.
    http_put_response_hop_limit = 1
  }

  block_device_mappings {
    device_name = var.root_device_name

    ebs {
      volume_type           = "gp3"
      volume_size           = var.root_volume_size_gb
      encrypted             = true
      delete_on_termination = true
    }
  }

  tags = var.tags
}

resource "aws_batch_compute_environment" "spot" {
  compute_environment_name_prefix = "${var.name}-spot-"
  type                            = "MANAGED"
  service_role                    = var.service_role_arn

  compute_resources {
    type                = "SPOT"
    allocation_strategy = "SPOT_PRICE_CAPACITY_OPTIMIZED"
    instance_type       = var.instance_types
    min_vcpus           = 0
    max_vcpus           = var.max_vcpus
    subnets             = var.subnet_ids
    security_group_ids  = [aws_security_group.batch.id]
    instance_role       = aws_iam_instance_profile.instance.arn

    ec2_configuration {
      image_type = var.ec2_image_type
    }

    launch_template {
      launch_template_id = aws_launch_template.batch.id
      version            = aws_launch_template.batch.latest_version
    }

    tags = merge(var.tags, { Name = "${var.name}-batch" })
  }

  tags = var.tags

  lifecycle {
    # Most compute_resources changes replace the environment; the queue must
    # never be left without one.
    create_before_destroy = true
  }
}

resource "aws_batch_job_queue" "index" {
  name     = "${var.name}-index"
  state    = "ENABLED"
  priority = 1

  compute_environment_order {
    order               = 1
    compute_environment = aws_batch_compute_environment.spot.arn
  }

  tags = var.tags
}

resource "aws_batch_job_definition" "index" {
  name                  = "${var.name}-index"
  type                  = "container"
  platform_capabilities = ["EC2"]
  propagate_tags        = true

  container_properties = jsonencode({
    image      = var.container_image
    command    = ["sh", "-c", var.index_command]
    jobRoleArn = aws_iam_role.job.arn
    resourceRequirements = [
      { type = "GPU", value = tostring(var.job_gpus) },
      { type = "VCPU", value = tostring(var.job_vcpus) },
      { type = "MEMORY", value = tostring(var.job_memory_mib) },
    ]
    environment = local.job_environment
    privileged  = false
    # tini as PID 1 forwards SIGTERM to ragkv and reaps its children.
    linuxParameters = { initProcessEnabled = true }
  })

  retry_strategy {
    attempts = var.retry_attempts

    dynamic "evaluate_on_exit" {
      for_each = local.retry_rules

      content {
        on_status_reason = evaluate_on_exit.value.on_status_reason
        on_exit_code     = evaluate_on_exit.value.on_exit_code
        on_reason        = evaluate_on_exit.value.on_reason
        action           = evaluate_on_exit.value.action
      }
    }
  }

  timeout {
    attempt_duration_seconds = var.job_timeout_seconds
  }

  tags = var.tags
}

resource "aws_batch_job_definition" "merge" {
  name                  = "${var.name}-index-merge"
  type                  = "container"
  platform_capabilities = ["EC2"]
  propagate_tags        = true

  container_properties = jsonencode({
    image      = var.container_image
    command    = ["sh", "-c", var.merge_command]
    jobRoleArn = aws_iam_role.job.arn
    resourceRequirements = [
      { type = "VCPU", value = tostring(var.merge_vcpus) },
      { type = "MEMORY", value = tostring(var.merge_memory_mib) },
    ]
    environment     = local.job_environment
    privileged      = false
    linuxParameters = { initProcessEnabled = true }
  })

  retry_strategy {
    attempts = var.retry_attempts

    dynamic "evaluate_on_exit" {
      for_each = local.retry_rules

      content {
        on_status_reason = evaluate_on_exit.value.on_status_reason
        on_exit_code     = evaluate_on_exit.value.on_exit_code
        on_reason        = evaluate_on_exit.value.on_reason
        action           = evaluate_on_exit.value.action
      }
    }
  }

  timeout {
    attempt_duration_seconds = var.job_timeout_seconds
  }

  tags = var.tags
}
