# Spot batch indexing: the KV bucket and an AWS Batch SPOT compute environment
# that precomputes every chunk's KV cache on GPUs, sharded as an array job and
# followed by the merge step. No serving tier: add one with enable_serving.
#
#   terraform init
#   terraform apply -target=module.ragkv.module.registry -var vpc_id=vpc-... -var 'subnet_ids=["subnet-a","subnet-b"]'
#   # push the image: docker build/push to $(terraform output -raw image_repository_url):0.1.0, and take its digest
#   terraform apply -var vpc_id=vpc-... -var 'subnet_ids=["subnet-a","subnet-b"]' -var image_digest=sha256:...
#   terraform output -raw batch_submit_commands   # then run them

terraform {
  required_version = ">= 1.9"

  required_providers {
    aws = {
      source  = "hashicorp/aws"
      version = ">= 5.70, < 6.0"
    }
  }
}

provider "aws" {
  region = var.region

  default_tags {
    tags = { Environment = "example" }
  }
}

variable "region" {
  description = "AWS region to deploy into."
  type        = string
  default     = "us-east-1"
}

variable "vpc_id" {
  description = "Existing VPC for the Batch instances."
  type        = string
}

variable "subnet_ids" {
  description = "Existing subnets, in several availability zones to widen the Spot pools."
  type        = list(string)
}

variable "image_tag" {
  description = "Tag of the image (built from the repository's Dockerfile) pushed to the ECR repository this deployment creates."
  type        = string
  default     = "0.1.0"
}

variable "image_digest" {
  description = "Digest (sha256:...) of the pushed image_tag: the jobs pull the image by it. Null only for the first apply, which creates the repository to push to (-target=module.ragkv.module.registry); the jobs refuse an image without one."
  type        = string
  default     = null
}

variable "corpus_s3_uri" {
  description = "S3 URI of the corpus to index; null uses s3://{kv bucket}/corpus."
  type        = string
  default     = null
}

module "ragkv" {
  source = "../.."

  name            = "ragkv-index"
  vpc_id          = var.vpc_id
  subnet_ids      = var.subnet_ids
  enable_serving  = false
  enable_indexing = true
  image_tag       = var.image_tag
  image_digest    = var.image_digest
  corpus_s3_uri   = var.corpus_s3_uri
  index_version   = "v1"
  index_max_vcpus = 32
  force_destroy   = true

  tags = { Example = "spot-indexing" }
}

output "image_repository_url" {
  description = "Push the image built from the Dockerfile here, as <this>:<image_tag>."
  value       = module.ragkv.image_repository_url
}

output "batch_job_queue_arn" {
  description = "Job queue of the Spot compute environment."
  value       = module.ragkv.batch_job_queue_arn
}

output "batch_submit_commands" {
  description = "Commands that run the sharded index build and then the merge step."
  value       = module.ragkv.batch_submit_commands
}

output "kv_s3_uri" {
  description = "Where the jobs write the KV files."
  value       = module.ragkv.kv_s3_uri
}
