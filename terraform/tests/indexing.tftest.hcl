# Plan-level checks of the Spot indexing module, offline (mock AWS provider).

mock_provider "aws" {
  mock_data "aws_partition" {
    defaults = { partition = "aws" }
  }
  mock_data "aws_region" {
    defaults = { name = "us-east-1" }
  }
  # Known at plan time so the job definitions' JSON can be inspected.
  mock_resource "aws_iam_role" {
    override_during = plan
    defaults        = { arn = "arn:aws:iam::123456789012:role/ragkv-test-index-job" }
  }
}

variables {
  name            = "ragkv-test"
  vpc_id          = "vpc-0123456789abcdef0"
  subnet_ids      = ["subnet-0aaaaaaaaaaaaaaaa", "subnet-0bbbbbbbbbbbbbbbb"]
  container_image = "123456789012.dkr.ecr.us-east-1.amazonaws.com/ragkv:0.1.0@sha256:0123456789abcdef0123456789abcdef0123456789abcdef0123456789abcdef"
  kv_bucket_arn   = "arn:aws:s3:::ragkv-test-kv"
  kv_bucket_name  = "ragkv-test-kv"
  kms_key_arn     = "arn:aws:kms:us-east-1:123456789012:key/11111111-2222-3333-4444-555555555555"
  tags            = { Project = "ragkv" }
}

run "compute_environment_is_spot_across_gpu_types" {
  command = plan

  module {
    source = "./modules/indexing"
  }

  assert {
    condition     = aws_batch_compute_environment.spot.compute_resources[0].type == "SPOT"
    error_message = "The compute environment must run on Spot."
  }

  assert {
    condition     = aws_batch_compute_environment.spot.compute_resources[0].allocation_strategy == "SPOT_PRICE_CAPACITY_OPTIMIZED"
    error_message = "Spot allocation must be price-capacity-optimized."
  }

  assert {
    condition     = length(aws_batch_compute_environment.spot.compute_resources[0].instance_type) >= 3
    error_message = "Several GPU instance types widen the Spot pools."
  }

  assert {
    condition     = aws_batch_compute_environment.spot.compute_resources[0].min_vcpus == 0
    error_message = "The environment must scale to zero when idle."
  }

  assert {
    condition     = aws_batch_compute_environment.spot.compute_resources[0].ec2_configuration[0].image_type == "ECS_AL2023_NVIDIA"
    error_message = "The instances need the GPU (NVIDIA) Batch AMI on Amazon Linux 2023 (Amazon Linux 2 reached end of support on 2026-06-30)."
  }
}

run "instances_are_hardened" {
  command = plan

  module {
    source = "./modules/indexing"
  }

  assert {
    condition     = aws_launch_template.batch.metadata_options[0].http_tokens == "required"
    error_message = "IMDSv2 must be required on the Batch instances."
  }

  assert {
    condition     = aws_launch_template.batch.metadata_options[0].http_put_response_hop_limit == 1
    error_message = "Hop limit 1: a job's container must not reach IMDS (the instance role); its credentials are the job role's."
  }

  assert {
    condition     = aws_launch_template.batch.block_device_mappings[0].ebs[0].encrypted == "true"
    error_message = "The Batch instances' root volume must be encrypted."
  }

  assert {
    condition     = strcontains(base64decode(aws_launch_template.batch.user_data), "ECS_ENABLE_SPOT_INSTANCE_DRAINING=true")
    error_message = "The ECS agent must drain tasks on a Spot notice."
  }
}

run "retry_strategy_covers_spot_reclamation_and_exit_75" {
  command = plan

  module {
    source = "./modules/indexing"
  }

  assert {
    condition     = aws_batch_job_definition.index.retry_strategy[0].attempts == 5
    error_message = "The indexing job must be retried (5 attempts by default)."
  }

  assert {
    condition = anytrue([
      for e in aws_batch_job_definition.index.retry_strategy[0].evaluate_on_exit :
      e.on_status_reason == "Host EC2*" && lower(e.action) == "retry"
    ])
    error_message = "A reclaimed host (status reason 'Host EC2*') must be retried."
  }

  assert {
    condition = anytrue([
      for e in aws_batch_job_definition.index.retry_strategy[0].evaluate_on_exit :
      e.on_exit_code == "75" && lower(e.action) == "retry"
    ])
    error_message = "The indexer's interruption exit code 75 must be retried."
  }

  assert {
    condition     = lower(aws_batch_job_definition.index.retry_strategy[0].evaluate_on_exit[length(aws_batch_job_definition.index.retry_strategy[0].evaluate_on_exit) - 1].action) == "exit"
    error_message = "Any other failure must be final (a catch-all EXIT comes last)."
  }

  assert {
    condition     = length(aws_batch_job_definition.merge.retry_strategy[0].evaluate_on_exit) == length(aws_batch_job_definition.index.retry_strategy[0].evaluate_on_exit)
    error_message = "The merge step runs on the same Spot queue and needs the same retry rules."
  }
}

run "job_definition_runs_ragkv_index_on_a_gpu_as_array_job" {
  command = plan

  module {
    source = "./modules/indexing"
  }

  assert {
    condition     = strcontains(jsondecode(aws_batch_job_definition.index.container_properties).command[2], "ragkv index")
    error_message = "The job must run `ragkv index`."
  }

  assert {
    condition     = strcontains(jsondecode(aws_batch_job_definition.index.container_properties).command[2], "AWS_BATCH_JOB_ARRAY_INDEX")
    error_message = "Array children must pick their shard from AWS_BATCH_JOB_ARRAY_INDEX."
  }

  assert {
    condition = anytrue([
      for r in jsondecode(aws_batch_job_definition.index.container_properties).resourceRequirements : r.type == "GPU" && r.value == "1"
    ])
    error_message = "The indexing job must reserve a GPU."
  }

  assert {
    condition     = jsondecode(aws_batch_job_definition.index.container_properties).linuxParameters.initProcessEnabled == true
    error_message = "An init process must forward SIGTERM to the indexer."
  }

  assert {
    condition     = strcontains(jsondecode(aws_batch_job_definition.merge.container_properties).command[2], "ragkv index merge")
    error_message = "The merge job must run `ragkv index merge`."
  }

  assert {
    condition     = contains([for e in jsondecode(aws_batch_job_definition.index.container_properties).environment : e.name], "RAGKV_KV_S3_URI")
    error_message = "The jobs must get the KV store URI."
  }

  assert {
    condition     = aws_batch_job_queue.index.state == "ENABLED"
    error_message = "The job queue must be enabled."
  }
}

run "job_role_reads_corpus_and_writes_only_its_prefixes" {
  command = plan

  module {
    source = "./modules/indexing"
  }

  variables {
    corpus_s3_uri = "s3://corpus-bucket/docs/"
  }

  assert {
    condition = anytrue([
      for s in jsondecode(aws_iam_role_policy.job.policy).Statement :
      s.Resource == "arn:aws:s3:::corpus-bucket/docs/*" && s.Action == ["s3:GetObject"]
    ])
    error_message = "The corpus must be readable (and only readable) under its prefix."
  }

  assert {
    condition = anytrue([
      for s in jsondecode(aws_iam_role_policy.job.policy).Statement :
      contains(flatten([s.Action]), "s3:PutObject") && contains(flatten([s.Resource]), "arn:aws:s3:::ragkv-test-kv/${var.index_prefix}/${var.index_version}/*")
      ]) && alltrue([
      for s in jsondecode(aws_iam_role_policy.job.policy).Statement :
      !contains(flatten([s.Resource]), "arn:aws:s3:::ragkv-test-kv/${var.index_prefix}/*")
    ])
    error_message = "The jobs write their own index version only, never every version under the index prefix."
  }

  assert {
    condition = alltrue([
      for s in jsondecode(aws_iam_role_policy.job.policy).Statement :
      !contains(flatten([s.Resource]), "*") && !contains(flatten([s.Action]), "s3:*")
    ])
    error_message = "No statement may use Resource \"*\" or s3:*."
  }

  assert {
    condition = anytrue([
      for s in jsondecode(aws_iam_role_policy.job.policy).Statement :
      s.Action == ["s3:ListBucket"] && s.Resource == "arn:aws:s3:::ragkv-test-kv" && !can(s.Condition)
    ])
    error_message = "ListBucket must be granted on the KV bucket without a prefix condition, so a missing KV object is a 404, not a 403."
  }

  assert {
    condition = anytrue([
      for s in jsondecode(aws_iam_role_policy.job.policy).Statement :
      s.Action == ["s3:DeleteObject"] && s.Resource == "arn:aws:s3:::ragkv-test-kv/kv/*"
    ])
    error_message = "The S3 tier deletes a KV object that fails verification: the job needs s3:DeleteObject under the KV prefix."
  }
}

run "single_instance_type_is_refused" {
  command = plan

  module {
    source = "./modules/indexing"
  }

  variables {
    instance_types = ["g5.xlarge"]
  }

  expect_failures = [var.instance_types]
}

run "session_manager_without_account_wide_parameter_reads" {
  command = plan

  module {
    source = "./modules/indexing"
  }

  variables {
    enable_ssm = true
  }

  assert {
    condition = length(aws_iam_role_policy.instance_ssm) == 1 && alltrue([
      for s in jsondecode(aws_iam_role_policy.instance_ssm[0].policy).Statement :
      alltrue([for a in flatten([s.Action]) : !startswith(a, "ssm:Get") && !strcontains(a, "*") && !startswith(a, "s3:") && !startswith(a, "kms:")])
    ])
    error_message = "Session Manager gets the agent's own actions only, not AmazonSSMManagedInstanceCore's account-wide ssm:GetParameter*."
  }
}

run "image_must_be_pinned_by_digest" {
  command = plan

  module {
    source = "./modules/indexing"
  }

  variables {
    container_image = "123456789012.dkr.ecr.us-east-1.amazonaws.com/ragkv:0.1.0"
  }

  expect_failures = [var.container_image]
}
