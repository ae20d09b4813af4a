variable "name" {
  description = "Name prefix for every resource of the serving tier."
  type        = string
}

variable "tags" {
  description = "Tags added to every taggable resource."
  type        = map(string)
  default     = {}
}

variable "vpc_id" {
  description = "VPC in which the instances, security groups and load balancer are created."
  type        = string
}

variable "subnet_ids" {
  description = "Subnets for the instances (and the load balancer). Private subnets with a NAT gateway or VPC endpoints for S3 are the intended setup."
  type        = list(string)

  validation {
    condition     = length(var.subnet_ids) > 0
    error_message = "subnet_ids must name at least one subnet."
  }
}

variable "instance_type" {
  description = "EC2 instance type. It needs an NVIDIA GPU; g5 types also bring the local NVMe instance store used as the SSD tier."
  type        = string
  default     = "g5.xlarge"
}

variable "ami_ssm_parameter" {
  description = "Public SSM parameter that holds the Deep Learning AMI id (NVIDIA driver preinstalled). Used when ami_id is null."
  type        = string
  default     = "/aws/service/deeplearning/ami/x86_64/base-oss-nvidia-driver-gpu-ubuntu-22.04/latest/ami-id"
}

variable "ami_id" {
  description = "Explicit AMI id, overriding the SSM lookup. The AMI needs the NVIDIA driver, Docker with the NVIDIA container toolkit, and the AWS CLI (the Deep Learning AMI has all three)."
  type        = string
  default     = null
}

variable "detailed_monitoring" {
  description = "Enable EC2 detailed (1-minute) monitoring."
  type        = bool
  default     = true
}

variable "root_device_name" {
  description = "Root device name of the AMI (Ubuntu-based Deep Learning AMIs use /dev/sda1); used by the launch template."
  type        = string
  default     = "/dev/sda1"
}

variable "root_volume_size_gb" {
  description = "Size of the encrypted gp3 root volume in GiB (the Deep Learning AMI needs at least 75)."
  type        = number
  default     = 200

  validation {
    condition     = var.root_volume_size_gb >= 75
    error_message = "root_volume_size_gb must be at least 75 GiB for the Deep Learning AMI."
  }
}

variable "root_volume_kms_key_id" {
  description = "KMS key ARN for the root volume. Null uses the account's default EBS key."
  type        = string
  default     = null
}

variable "kv_bucket_arn" {
  description = "ARN of the KV bucket (from the kv-bucket module)."
  type        = string
}

variable "kv_bucket_name" {
  description = "Name of the KV bucket (from the kv-bucket module)."
  type        = string
}

variable "kms_key_arn" {
  description = "ARN of the KMS key that encrypts the KV bucket."
  type        = string
}

variable "kv_prefix" {
  description = "Key prefix of the KV files; the instances may read and write only under it."
  type        = string
  default     = "kv"
}

variable "index_prefix" {
  description = "Key prefix of the built indexes; the instances may only read under it."
  type        = string
  default     = "index"
}

variable "index_version" {
  description = "Index version to serve: the folder s3://{bucket}/{index_prefix}/{index_version}/ written by `ragkv index` / `ragkv index merge`."
  type        = string
  default     = "latest"

  validation {
    condition     = can(regex("^[A-Za-z0-9._-]+$", var.index_version))
    error_message = "index_version must be a single path segment of letters, digits, '.', '_' or '-'."
  }
}

variable "container_image" {
  description = "Image the instances run under systemd, REGISTRY/NAME:TAG (built from the repository's Dockerfile and pushed to the deployment's ECR repository)."
  type        = string

  validation {
    condition     = can(regex("^[0-9]{12}\\.dkr\\.ecr\\.[a-z0-9-]+\\.amazonaws\\.com(\\.cn)?/[a-z0-9._/-]+:[A-Za-z0-9_][A-Za-z0-9._-]*$", var.container_image))
    error_message = "container_image must be an ECR image with a tag, ACCOUNT.dkr.ecr.REGION.amazonaws.com/NAME:TAG: the hosts pull only what was built and pushed."
  }
}

variable "ecr_repository_arn" {
  description = "ARN of the ECR repository that holds container_image; the instances may pull only from it."
  type        = string
}

variable "environment" {
  description = "Extra environment for `ragkv serve` (RAGKV_... settings), written to /etc/ragkv/ragkv.env."
  type        = map(string)
  default     = {}

  validation {
    condition     = alltrue([for k in keys(var.environment) : can(regex("^[A-Z_][A-Z0-9_]*$", k))])
    error_message = "environment keys must be upper-case shell variable names such as RAGKV_KV_CPU_BYTES."
  }
}

variable "grpc_port" {
  description = "Port of the gRPC API (and its grpc.health.v1 service)."
  type        = number
  default     = 50051
}

variable "metrics_port" {
  description = "Port of the Prometheus metrics endpoint."
  type        = number
  default     = 9464
}

variable "health_port" {
  description = "Port of the local HTTP bridge that answers 200 only while grpc.health.v1 reports SERVING; the load balancer's health check uses it."
  type        = number
  default     = 8081
}

variable "allowed_cidrs" {
  description = "IPv4 CIDR blocks admitted to the gRPC and metrics ports. Empty by default; 0.0.0.0/0 is refused unless allow_public_ingress is true."
  type        = list(string)
  default     = []

  validation {
    condition     = alltrue([for c in var.allowed_cidrs : can(cidrhost(c, 0))])
    error_message = "Each entry of allowed_cidrs must be a valid IPv4 CIDR block."
  }

  validation {
    condition     = var.allow_public_ingress || !contains(var.allowed_cidrs, "0.0.0.0/0")
    error_message = "allowed_cidrs contains 0.0.0.0/0: the API would be open to the internet. Name your clients' CIDRs, or set allow_public_ingress = true if you really mean it."
  }
}

variable "allow_public_ingress" {
  description = "Permit 0.0.0.0/0 in allowed_cidrs. Leave false unless the API is protected by other means."
  type        = bool
  default     = false
}

variable "allowed_security_group_ids" {
  description = "Security groups whose members are admitted to the gRPC and metrics ports."
  type        = list(string)
  default     = []
}

variable "egress_cidrs" {
  description = "CIDR blocks the instances may reach on TCP 80/443 (S3, ECR, SSM, package mirrors)."
  type        = list(string)
  default     = ["0.0.0.0/0"]
}

variable "instance_count" {
  description = "Number of standalone instances when create_autoscaling_group is false."
  type        = number
  default     = 1

  validation {
    condition     = var.instance_count >= 0
    error_message = "instance_count must not be negative."
  }
}

variable "create_autoscaling_group" {
  description = "Run the replicas in an Auto Scaling group (from a launch template) instead of standalone instances."
  type        = bool
  default     = false
}

variable "asg_min_size" {
  description = "Minimum replicas of the Auto Scaling group."
  type        = number
  default     = 1
}

variable "asg_max_size" {
  description = "Maximum replicas of the Auto Scaling group."
  type        = number
  default     = 2
}

variable "asg_desired_capacity" {
  description = "Desired replicas of the Auto Scaling group."
  type        = number
  default     = 1
}

variable "health_check_grace_period" {
  description = "Seconds a new instance has to pull the image, fetch the index and load the model before health checks count."
  type        = number
  default     = 1800
}

variable "create_load_balancer" {
  description = "Create a Network Load Balancer in front of the replicas, health-checked through the gRPC health bridge."
  type        = bool
  default     = false
}

variable "load_balancer_internal" {
  description = "Make the load balancer internal (reachable only inside the VPC and peered networks)."
  type        = bool
  default     = true
}

variable "load_balancer_deletion_protection" {
  description = "Protect the load balancer from deletion; set false for short-lived environments."
  type        = bool
  default     = true
}

variable "load_balancer_access_log_bucket" {
  description = "Existing bucket for load balancer access logs. Null disables them."
  type        = string
  default     = null
}

variable "enable_ssm" {
  description = "Attach AmazonSSMManagedInstanceCore so operators reach instances through Session Manager (no SSH port is ever opened)."
  type        = bool
  default     = true
}

variable "ray_cluster" {
  description = "Serve as a Ray cluster instead of independent hosts: a head node (on demand, head_instance_type) runs Ray's head and `ragkv serve --replicas`, and the Auto Scaling group's GPU instances are Ray workers, one engine replica per GPU, routed by the chunks each holds. The load balancer forwards gRPC and HTTP to Ray Serve's proxies on every node."
  type        = bool
  default     = false
}

variable "head_instance_type" {
  description = "Instance type of the Ray head node (ray_cluster): Ray's control plane, the Serve ingress (retrieval and routing) and proxies. It needs no GPU."
  type        = string
  default     = "m6i.2xlarge"
}

variable "ray_replicas" {
  description = "Engine replicas `ragkv serve --replicas` deploys (ray_cluster): one per worker GPU, so at most the workers' GPUs (asg_desired_capacity on g5.xlarge)."
  type        = number
  default     = 2

  validation {
    condition     = var.ray_replicas >= 1
    error_message = "ray_replicas must be at least 1."
  }
}

variable "ray_routing" {
  description = "How the ingress routes requests to replicas (ray_cluster): chunk (by the chunks each replica's tiers hold, power-of-two choices when queues are imbalanced) or pow2."
  type        = string
  default     = "chunk"

  validation {
    condition     = contains(["chunk", "pow2"], var.ray_routing)
    error_message = "ray_routing must be chunk or pow2."
  }
}

variable "ray_port" {
  description = "Port of Ray's GCS on the head node (ray_cluster); like every Ray port, open only inside the cluster's security group."
  type        = number
  default     = 6379
}

variable "http_port" {
  description = "Port of the OpenAI-compatible HTTP API (ray_cluster: Ray Serve's HTTP proxy, whose /-/healthz the load balancer checks)."
  type        = number
  default     = 8000
}
