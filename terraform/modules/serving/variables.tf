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

variable "model" {
  description = "The model `ragkv serve --model` loads: a shipped name, a pinned hub id or a folder in the image (the S3 index's manifest, written by the indexing job, does not choose it)."
  type        = string
  default     = "smollm2-135m-instruct"

  validation {
    condition     = can(regex("^[A-Za-z0-9][A-Za-z0-9._/@:-]*$", var.model))
    error_message = "model must be a model name, hub id or path: letters, digits and . _ / @ : - only (it goes into the hosts' command line)."
  }
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
  description = "Image the instances run under systemd, pinned by digest: REGISTRY/NAME:TAG@sha256:DIGEST (built from the repository's Dockerfile and pushed to the deployment's ECR repository). The digest is what the hosts pull; the tag only names it."
  type        = string

  validation {
    condition     = can(regex("^[0-9]{12}\\.dkr\\.ecr\\.[a-z0-9-]+\\.amazonaws\\.com(\\.cn)?/[a-z0-9._/-]+(:[A-Za-z0-9_][A-Za-z0-9._-]*)?@sha256:[0-9a-f]{64}$", var.container_image))
    error_message = "container_image must be an ECR image pinned by digest, ACCOUNT.dkr.ecr.REGION.amazonaws.com/NAME[:TAG]@sha256:DIGEST (the root module: set image_digest to the pushed image_tag's digest): the hosts pull only what was built and pushed, and exactly that image."
  }
}

variable "ecr_repository_arn" {
  description = "ARN of the ECR repository that holds container_image; the instances may pull only from it."
  type        = string
}

variable "environment" {
  description = "Extra environment for `ragkv serve` (RAGKV_... settings), written to /etc/ragkv/ragkv.env. No secrets: user data is readable by anyone who may describe the instance, so names that look like a token, password, secret or API key are refused (credentials go in api_keys_json)."
  type        = map(string)
  default     = {}

  validation {
    condition     = alltrue([for k in keys(var.environment) : can(regex("^[A-Z_][A-Z0-9_]*$", k))])
    error_message = "environment keys must be upper-case shell variable names such as RAGKV_KV_CPU_BYTES."
  }

  validation {
    condition     = alltrue([for k in keys(var.environment) : endswith(k, "_FILE") || !can(regex("(TOKEN|SECRET|PASSWORD|PASSWD|CREDENTIAL|API_KEY|ACCESS_KEY)", k))])
    error_message = "environment must not carry credentials (a token, password, secret or key in user data reaches every host in clear): put API keys in api_keys_json, which the hosts read from SSM."
  }
}

variable "api_keys_json" {
  description = "The API keys file of `ragkv serve --api-keys`: a JSON list of named keys, each with `key` or (better: the file then holds no secret) `key_sha256`. Stored as an SSM SecureString under the tier's own KMS key; the hosts read it at boot into a file only the container's user reads."
  type        = string
  sensitive   = true
  nullable    = false

  validation {
    condition = try(length(jsondecode(var.api_keys_json)) > 0 && alltrue([
      for k in jsondecode(var.api_keys_json) : can(k.name) && (can(k.key) != can(k.key_sha256))
    ]), false)
    error_message = "api_keys_json must be a non-empty JSON list of keys, each with a name and exactly one of key or key_sha256."
  }

  validation {
    condition     = length(var.api_keys_json) <= 8192
    error_message = "api_keys_json must fit an SSM parameter (8 KiB); list key_sha256 rather than keys."
  }
}

variable "kms_deletion_window_days" {
  description = "Waiting period in days before the API keys' KMS key is deleted."
  type        = number
  default     = 30

  validation {
    condition     = var.kms_deletion_window_days >= 7 && var.kms_deletion_window_days <= 30
    error_message = "kms_deletion_window_days must be between 7 and 30."
  }
}

variable "writeback_prefix" {
  description = "Key prefix under which the serving hosts may write back KV computed at serve time (they read all of kv_prefix, write only here, delete nothing). Null: {kv_prefix}/serve-writeback."
  type        = string
  default     = null
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
  description = "IPv4 CIDR blocks admitted to the gRPC and metrics ports. Empty by default; a block larger than a /8 (0.0.0.0/0, or 0.0.0.0/1 and 128.0.0.0/1) is refused unless allow_public_ingress is true."
  type        = list(string)
  default     = []

  validation {
    condition     = alltrue([for c in var.allowed_cidrs : can(cidrhost(c, 0))])
    error_message = "Each entry of allowed_cidrs must be a valid IPv4 CIDR block."
  }

  validation {
    # by size, not by spelling: 0.0.0.0/1 with 128.0.0.0/1 is the internet as much as 0.0.0.0/0 is
    condition     = var.allow_public_ingress || alltrue([for c in var.allowed_cidrs : can(cidrhost(c, 0)) ? tonumber(split("/", c)[1]) >= 8 : true])
    error_message = "allowed_cidrs holds a block larger than a /8 (0.0.0.0/0, or its halves and quarters): the API would be open to much of the internet. Name your clients' CIDRs (/8 or smaller), or set allow_public_ingress = true if you really mean it."
  }
}

variable "allow_public_ingress" {
  description = "Permit blocks larger than a /8 (0.0.0.0/0) in allowed_cidrs. Leave false unless the API is protected by other means."
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
  description = "Let operators reach the instances through Session Manager (no SSH port is ever opened): an inline policy with the agent's own actions only, not AmazonSSMManagedInstanceCore, which may read every SSM parameter in the account."
  type        = bool
  default     = true
}

variable "certificate_arn" {
  description = "ACM certificate the load balancer's TLS listeners present. Required with create_load_balancer unless allow_plaintext_listeners is true."
  type        = string
  default     = null

  validation {
    condition     = !var.create_load_balancer || var.allow_plaintext_listeners || var.certificate_arn != null
    error_message = "create_load_balancer needs certificate_arn (an ACM certificate for its TLS listeners), or allow_plaintext_listeners = true to accept plaintext TCP listeners."
  }
}

variable "ssl_policy" {
  description = "Security policy of the TLS listeners: TLS 1.3 and 1.2 only by default."
  type        = string
  default     = "ELBSecurityPolicy-TLS13-1-2-2021-06"

  validation {
    condition     = can(regex("^ELBSecurityPolicy-TLS13-1-[23]-", var.ssl_policy))
    error_message = "ssl_policy must be an ELBSecurityPolicy-TLS13-1-2-* or -1-3-* policy (TLS 1.2 at least)."
  }
}

variable "allow_plaintext_listeners" {
  description = "Give the load balancer plaintext TCP listeners instead of TLS. Off by default; set it only where another layer encrypts the traffic."
  type        = bool
  default     = false
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

variable "ray_object_store_bytes" {
  description = "Bytes of Ray's object store on each node (ray_cluster): where the replicas' peer tier publishes chunk KV for the others to read. It lives in the container's /dev/shm (8 GiB), so at most 7 GiB."
  type        = number
  default     = 4294967296

  validation {
    condition     = var.ray_object_store_bytes >= 1073741824 && var.ray_object_store_bytes <= 7516192768
    error_message = "ray_object_store_bytes must be between 1 GiB (1073741824) and 7 GiB (7516192768): the object store lives in the container's 8 GiB /dev/shm."
  }
}

variable "ray_peer_tier_bytes" {
  description = "Bytes of chunk KV each engine replica publishes to the object store for its peers (ray_cluster, `ragkv serve --peer-tier-bytes`); 0 turns the peer tier off (`--peer-tier off`)."
  type        = number
  default     = 2147483648

  validation {
    condition     = var.ray_peer_tier_bytes >= 0 && var.ray_peer_tier_bytes <= var.ray_object_store_bytes
    error_message = "ray_peer_tier_bytes must be between 0 (the peer tier off) and ray_object_store_bytes: what a replica publishes lives in its node's object store."
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
