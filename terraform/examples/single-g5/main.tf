# The smallest useful deployment: the KV bucket and one g5.xlarge serving
# instance, reachable on gRPC and metrics only from the VPC's own CIDR, every call
# authenticated with one of the API keys (kept in SSM, read by the host at boot).
#
#   terraform init
#   export TF_VAR_api_keys_json='[{"name": "ops", "key_sha256": "<sha256 of your key>"}]'
#   terraform apply -target=module.ragkv.module.registry   # the repository first
#   # push the image: docker build/push to $(terraform output -raw image_repository_url):0.1.0
#   terraform apply -var vpc_id=vpc-... -var subnet_id=subnet-... -var client_cidr=10.0.0.0/16 \
#     -var image_digest=sha256:...   # the pushed image's digest: the instance pulls exactly it

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
  description = "AWS region to deploy into (it needs g5 capacity)."
  type        = string
  default     = "us-east-1"
}

variable "vpc_id" {
  description = "Existing VPC for the instance."
  type        = string
}

variable "subnet_id" {
  description = "Existing subnet (private, with a NAT gateway or an S3 endpoint) for the instance."
  type        = string
}

variable "image_tag" {
  description = "Tag of the image (built from the repository's Dockerfile) pushed to the ECR repository this deployment creates."
  type        = string
  default     = "0.1.0"
}

variable "image_digest" {
  description = "Digest (sha256:...) of the pushed image_tag; the hosts pull the image by it."
  type        = string
}

variable "api_keys_json" {
  description = "API keys file of the server (JSON list of {name, key_sha256}); kept in SSM, never in user data. Pass it as TF_VAR_api_keys_json."
  type        = string
  sensitive   = true
}

variable "client_cidr" {
  description = "CIDR block of the clients allowed to reach gRPC and metrics, e.g. the VPC's CIDR."
  type        = string
}

module "ragkv" {
  source = "../.."

  name          = "ragkv-single"
  vpc_id        = var.vpc_id
  subnet_ids    = [var.subnet_id]
  instance_type = "g5.xlarge"
  allowed_cidrs = [var.client_cidr]
  index_version = "latest"
  image_tag     = var.image_tag
  image_digest  = var.image_digest
  api_keys_json = var.api_keys_json
  force_destroy = true

  tags = { Example = "single-g5" }
}

output "image_repository_url" {
  description = "Push the image built from the Dockerfile here, as <this>:<image_tag>."
  value       = module.ragkv.image_repository_url
}

output "grpc_endpoints" {
  description = "Dial one of these with `ragkv query --server HOST:PORT`."
  value       = module.ragkv.grpc_endpoints
}

output "kv_s3_uri" {
  description = "Build the index into this KV store: `ragkv index CORPUS --out DIR --kv-store <this>`."
  value       = module.ragkv.kv_s3_uri
}

output "index_s3_uri" {
  description = "Upload the built index to <this>/latest/ before the instance starts serving."
  value       = module.ragkv.index_s3_uri
}
