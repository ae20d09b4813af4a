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
    condition     = module.registry.repository_url == "123456789012.dkr.ecr.us-east-1.amazonaws.com/ragkv" && output.container_image == "123456789012.dkr.ecr.us-east-1.amazonaws.com/ragkv:0.2.0"
    error_message = "The image is the created ECR repository at image_tag."
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
