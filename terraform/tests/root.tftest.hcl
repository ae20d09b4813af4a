# Plan-level checks of the composed root module, offline (mock AWS provider).

mock_provider "aws" {
  mock_data "aws_partition" {
    defaults = { partition = "aws" }
  }
  mock_data "aws_caller_identity" {
    defaults = { account_id = "123456789012" }
  }
  mock_data "aws_region" {
    defaults = { name = "us-east-1" }
  }
  mock_data "aws_ssm_parameter" {
    defaults = { insecure_value = "ami-0dlami0000000000", value = "ami-0dlami0000000000" }
  }
  mock_data "aws_vpc" {
    defaults = {
      cidr_block              = "10.0.0.0/16"
      cidr_block_associations = [{ association_id = "vpc-cidr-assoc-0123", cidr_block = "10.0.0.0/16", state = "associated" }]
    }
  }
  # Known at plan time so the image name can be checked.
  mock_resource "aws_ecr_repository" {
    override_during = plan
    defaults = {
      repository_url = "123456789012.dkr.ecr.us-east-1.amazonaws.com/ragkv"
      arn            = "arn:aws:ecr:us-east-1:123456789012:repository/ragkv"
    }
  }
}

variables {
  vpc_id        = "vpc-0123456789abcdef0"
  subnet_ids    = ["subnet-0aaaaaaaaaaaaaaaa"]
  allowed_cidrs = ["10.0.0.0/16"]
  image_digest  = "sha256:0123456789abcdef0123456789abcdef0123456789abcdef0123456789abcdef"
  api_keys_json = "[{\"name\": \"ops\", \"key_sha256\": \"9f86d081884c7d659a2feaa0c55ad015a3bf4f1b2b0b822cd15d6c15b0f00a08\"}]"
}

run "defaults_create_bucket_and_one_serving_instance" {
  command = plan

  assert {
    condition     = length(module.serving) == 1 && length(module.indexing) == 0
    error_message = "By default serving is on and Spot indexing is off."
  }

  assert {
    condition     = length(output.serving_instance_ids) == 1
    error_message = "One standalone serving instance by default."
  }

  assert {
    condition     = output.batch_job_queue_arn == null
    error_message = "No Batch queue unless enable_indexing is set."
  }
}

run "everything_on" {
  command = plan

  variables {
    enable_indexing          = true
    image_tag                = "0.2.0"
    create_autoscaling_group = true
    create_load_balancer     = true
    certificate_arn          = "arn:aws:acm:us-east-1:123456789012:certificate/11111111-2222-3333-4444-555555555555"
  }

  assert {
    condition     = length(module.serving) == 1 && length(module.indexing) == 1
    error_message = "Both tiers must be created."
  }

  assert {
    condition     = length(output.serving_instance_ids) == 0
    error_message = "With an Auto Scaling group there are no standalone instances."
  }
}

run "both_tiers_run_the_image_from_the_deployments_repository" {
  command = plan

  variables {
    enable_indexing = true
    image_tag       = "0.2.0"
  }

  assert {
    condition     = module.registry.repository_url == "123456789012.dkr.ecr.us-east-1.amazonaws.com/ragkv" && output.container_image == "123456789012.dkr.ecr.us-east-1.amazonaws.com/ragkv:0.2.0@sha256:0123456789abcdef0123456789abcdef0123456789abcdef0123456789abcdef"
    error_message = "The image is the created ECR repository at image_tag, pinned by image_digest."
  }

  assert {
    condition = anytrue([
      for r in jsondecode(module.registry.lifecycle_policy).rules :
      r.rulePriority == 1 && contains(try(r.selection.tagPatternList, []), "0.2.0")
    ])
    error_message = "The deployed image_tag must be protected from the registry's lifecycle policy."
  }
}

run "image_tag_must_be_a_docker_tag" {
  command = plan

  variables {
    image_tag = "-bad tag"
  }

  expect_failures = [var.image_tag]
}

run "public_ingress_is_refused_at_the_root" {
  command = plan

  variables {
    allowed_cidrs = ["10.0.0.0/8", "0.0.0.0/0"]
  }

  expect_failures = [var.allowed_cidrs]
}

run "public_ingress_split_in_halves_is_refused_at_the_root" {
  command = plan

  variables {
    allowed_cidrs = ["0.0.0.0/1", "128.0.0.0/1"]
  }

  expect_failures = [var.allowed_cidrs]
}

run "serving_needs_api_keys" {
  command = plan

  variables {
    api_keys_json = null
  }

  expect_failures = [var.api_keys_json]
}

run "indexing_alone_needs_no_api_keys_but_a_digest" {
  command = plan

  variables {
    enable_serving  = false
    enable_indexing = true
    api_keys_json   = null
  }

  assert {
    condition     = length(module.serving) == 0 && output.container_image == "123456789012.dkr.ecr.us-east-1.amazonaws.com/ragkv:0.1.0@sha256:0123456789abcdef0123456789abcdef0123456789abcdef0123456789abcdef"
    error_message = "Without serving no keys are needed, and the jobs run the image by its digest."
  }
}

run "image_digest_must_be_a_sha256_digest" {
  command = plan

  variables {
    image_digest = "latest"
  }

  expect_failures = [var.image_digest]
}
