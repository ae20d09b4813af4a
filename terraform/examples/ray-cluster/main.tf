# ragkv on a Ray cluster: the KV bucket, a head node (on demand) that runs Ray's head
# and `ragkv serve --replicas` (Ray Serve), two g5.xlarge workers in an Auto Scaling
# group (one engine replica per GPU, each with its own CPU and NVMe tiers over the
# shared S3 tier), and an internal Network Load Balancer forwarding gRPC and the
# OpenAI HTTP API to Ray Serve's proxies. Requests go to the replica holding their
# chunks (an agent's next call to the one holding its conversation).
#
# The listeners terminate TLS with certificate_arn; every call needs one of the API keys.
#
#   terraform init
#   export TF_VAR_api_keys_json='[{"name": "ops", "key_sha256": "<sha256 of your key>"}]'
#   terraform apply -target=module.ragkv.module.registry   # the repository first
#   # push the image (built from the Dockerfile) to $(terraform output -raw image_repository_url):0.1.0
#   terraform apply -var vpc_id=vpc-... -var 'subnet_ids=["subnet-...","subnet-..."]' -var client_cidr=10.0.0.0/16 \
#     -var certificate_arn=arn:aws:acm:... -var image_digest=sha256:...
#   # the nodes pull the image by digest, then Ray starts and Serve deploys.

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
  description = "Existing VPC for the cluster."
  type        = string
}

variable "subnet_ids" {
  description = "Existing private subnets (with a NAT gateway or an S3 endpoint); the load balancer spans them."
  type        = list(string)
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

variable "certificate_arn" {
  description = "ACM certificate for the load balancer's TLS listeners (gRPC and HTTP), e.g. for ragkv.internal.example.com."
  type        = string
}

variable "client_cidr" {
  description = "CIDR block of the clients allowed to reach gRPC, HTTP and metrics, e.g. the VPC's CIDR."
  type        = string
}

module "ragkv" {
  source = "../.."

  name                 = "ragkv-ray"
  vpc_id               = var.vpc_id
  subnet_ids           = var.subnet_ids
  instance_type        = "g5.xlarge"
  ray_cluster          = true
  ray_replicas         = 2
  asg_min_size         = 2
  asg_desired_capacity = 2
  asg_max_size         = 2
  create_load_balancer = true
  allowed_cidrs        = [var.client_cidr]
  index_version        = "latest"
  image_tag            = var.image_tag
  image_digest         = var.image_digest
  api_keys_json        = var.api_keys_json
  certificate_arn      = var.certificate_arn
  force_destroy        = true

  tags = { Example = "ray-cluster" }
}

output "image_repository_url" {
  description = "Push the image built from the Dockerfile here, as <this>:<image_tag>."
  value       = module.ragkv.image_repository_url
}

output "grpc_endpoints" {
  description = "Dial this with `ragkv query --server HOST:PORT` (Ray Serve's gRPC proxies behind the load balancer)."
  value       = module.ragkv.grpc_endpoints
}

output "http_endpoint" {
  description = "The OpenAI-compatible API: base_url http://<this>/v1."
  value       = module.ragkv.http_endpoint
}

output "index_s3_uri" {
  description = "Upload the built index to <this>/latest/ before the cluster starts serving."
  value       = module.ragkv.index_s3_uri
}
