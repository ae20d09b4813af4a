variable "name" {
  description = "Name prefix for every resource (lowercase letters, digits and hyphens)."
  type        = string
  default     = "ragkv"

  validation {
    condition     = can(regex("^[a-z0-9][a-z0-9-]{1,30}[a-z0-9]$", var.name))
    error_message = "name must be 3-32 characters of lowercase letters, digits and hyphens."
  }
}

variable "tags" {
  description = "Tags added to every taggable resource, besides the module's own Project and ManagedBy tags."
  type        = map(string)
  default     = {}
}

variable "vpc_id" {
  description = "VPC in which the serving instances and the Batch compute environment run."
  type        = string
}

variable "subnet_ids" {
  description = "Subnets (preferably private, in several availability zones) for the instances, load balancer and Batch."
  type        = list(string)
}

# --- KV bucket ---

variable "bucket_name" {
  description = "Exact name of the KV bucket. Null derives a unique name from var.name."
  type        = string
  default     = null
}

variable "kv_prefix" {
  description = "Key prefix of the KV files in the bucket ({kv_prefix}/{model_fp}/{key[:2]}/{key}.safetensors)."
  type        = string
  default     = "kv"
}

variable "index_prefix" {
  description = "Key prefix of the built indexes in the bucket (one folder per index version)."
  type        = string
  default     = "index"
}

variable "model" {
  description = "The model the serving tier loads (`ragkv serve --model`): a shipped name, a pinned hub id or a folder in the image. The index in S3 is written by the indexing job, which parses untrusted documents, so its manifest does not choose it; an index built with another model is refused by name."
  type        = string
  default     = "smollm2-135m-instruct"

  validation {
    condition     = can(regex("^[A-Za-z0-9][A-Za-z0-9._/@:-]*$", var.model))
    error_message = "model must be a model name, hub id or path: letters, digits and . _ / @ : - only (it goes into the hosts' command line)."
  }
}

variable "index_version" {
  description = "Index version the serving tier fetches and the indexing jobs write by default."
  type        = string
  default     = "latest"
}

variable "expired_prefixes" {
  description = "Key prefixes of retired index versions or model fingerprints whose objects expire (e.g. [\"kv/<old model_fp>\", \"index/v1\"])."
  type        = list(string)
  default     = []
}

variable "expired_prefix_days" {
  description = "Days after which objects under an expired prefix are deleted."
  type        = number
  default     = 1
}

variable "access_log_bucket" {
  description = "Existing bucket for S3 server access logs of the KV bucket. Null disables them."
  type        = string
  default     = null
}

variable "force_destroy" {
  description = "Allow destroy to delete a non-empty KV bucket and an ECR repository that holds images (for short-lived environments)."
  type        = bool
  default     = false
}

# --- Image ---

variable "image_tag" {
  description = "Tag of the image (built from the repository's Dockerfile) in the ECR repository this module creates; the serving hosts and the Batch jobs run it."
  type        = string
  default     = "0.1.0"

  validation {
    condition     = can(regex("^[A-Za-z0-9_][A-Za-z0-9._-]{0,127}$", var.image_tag))
    error_message = "image_tag must be a Docker tag: up to 128 letters, digits, '_', '.' or '-', not starting with '.' or '-'."
  }
}

variable "image_digest" {
  description = "Digest (sha256:...) of the pushed image_tag: the serving hosts and the Batch jobs pull the image by it (REPOSITORY:TAG@DIGEST). Every tier that runs the image requires it (serving and indexing refuse an image without one); only the first step, creating the repository (`terraform apply -target=module.registry`), runs before there is an image to name. Push, then apply with the digest."
  type        = string
  default     = null

  validation {
    condition     = var.image_digest == null || can(regex("^sha256:[0-9a-f]{64}$", var.image_digest))
    error_message = "image_digest must be sha256: followed by 64 lowercase hex digits (docker inspect --format '{{index .RepoDigests 0}}' IMAGE prints it after the @)."
  }
}

# --- Serving ---

variable "enable_serving" {
  description = "Create the serving tier (GPU instances running `ragkv serve`)."
  type        = bool
  default     = true
}

variable "instance_type" {
  description = "EC2 instance type of the serving tier."
  type        = string
  default     = "g5.xlarge"
}

variable "ami_ssm_parameter" {
  description = "Public SSM parameter holding the Deep Learning AMI id for the serving tier."
  type        = string
  default     = "/aws/service/deeplearning/ami/x86_64/base-oss-nvidia-driver-gpu-ubuntu-22.04/latest/ami-id"
}

variable "ami_id" {
  description = "Explicit AMI id for the serving tier, overriding the SSM lookup."
  type        = string
  default     = null
}

variable "detailed_monitoring" {
  description = "Enable EC2 detailed (1-minute) monitoring on the serving instances."
  type        = bool
  default     = true
}

variable "serving_environment" {
  description = "Extra RAGKV_... environment for `ragkv serve`, written into user data: no credentials (names like *TOKEN*, *SECRET*, *PASSWORD*, *API_KEY* are refused); the API keys go in api_keys_json."
  type        = map(string)
  default     = {}
}

variable "api_keys_json" {
  description = "The serving tier's API keys file (`ragkv serve --api-keys`): a JSON list of named keys, each with key or key_sha256. Kept in an SSM SecureString under its own KMS key, read by the hosts at boot. Required with enable_serving."
  type        = string
  default     = null
  sensitive   = true

  validation {
    condition     = !var.enable_serving || var.api_keys_json != null
    error_message = "The serving tier refuses unauthenticated calls: set api_keys_json (e.g. export TF_VAR_api_keys_json='[{\"name\": \"ops\", \"key_sha256\": \"...\"}]')."
  }
}

variable "grpc_port" {
  description = "Port of the gRPC API."
  type        = number
  default     = 50051
}

variable "metrics_port" {
  description = "Port of the Prometheus metrics endpoint."
  type        = number
  default     = 9464
}

variable "allowed_cidrs" {
  description = "IPv4 CIDR blocks admitted to the gRPC and metrics ports. Empty by default; a block larger than a /8 (0.0.0.0/0, or 0.0.0.0/1 and 128.0.0.0/1) is refused unless allow_public_ingress is true."
  type        = list(string)
  default     = []

  validation {
    # by size, not by spelling: 0.0.0.0/1 with 128.0.0.0/1 is the internet as much as 0.0.0.0/0 is
    condition     = var.allow_public_ingress || alltrue([for c in var.allowed_cidrs : can(cidrhost(c, 0)) ? tonumber(split("/", c)[1]) >= 8 : true])
    error_message = "allowed_cidrs holds a block larger than a /8 (0.0.0.0/0, or its halves and quarters): the API would be open to much of the internet. Name your clients' CIDRs (/8 or smaller), or set allow_public_ingress = true if you really mean it."
  }
}

variable "allow_public_ingress" {
  description = "Permit blocks larger than a /8 (0.0.0.0/0) in allowed_cidrs."
  type        = bool
  default     = false
}

variable "allowed_security_group_ids" {
  description = "Security groups whose members are admitted to the gRPC and metrics ports."
  type        = list(string)
  default     = []
}

variable "instance_count" {
  description = "Standalone serving instances when create_autoscaling_group is false."
  type        = number
  default     = 1
}

variable "create_autoscaling_group" {
  description = "Run serving replicas in an Auto Scaling group instead of standalone instances."
  type        = bool
  default     = false
}

variable "asg_min_size" {
  description = "Minimum serving replicas in the Auto Scaling group."
  type        = number
  default     = 1
}

variable "asg_max_size" {
  description = "Maximum serving replicas in the Auto Scaling group."
  type        = number
  default     = 2
}

variable "asg_desired_capacity" {
  description = "Desired serving replicas in the Auto Scaling group."
  type        = number
  default     = 1
}

variable "create_load_balancer" {
  description = "Put a Network Load Balancer (health-checked through grpc.health.v1) in front of the serving replicas."
  type        = bool
  default     = false
}

variable "load_balancer_internal" {
  description = "Make the load balancer internal."
  type        = bool
  default     = true
}

variable "certificate_arn" {
  description = "ACM certificate of the load balancer's TLS listeners (TLS 1.2/1.3). Required with create_load_balancer unless allow_plaintext_listeners is true."
  type        = string
  default     = null
}

variable "allow_plaintext_listeners" {
  description = "Give the load balancer plaintext TCP listeners instead of TLS. Off by default; set it only where another layer encrypts the traffic."
  type        = bool
  default     = false
}

variable "load_balancer_deletion_protection" {
  description = "Protect the load balancer from deletion. While true, terraform destroy fails: apply with false first."
  type        = bool
  default     = true
}

variable "ray_cluster" {
  description = "Serve as a Ray cluster: a head node (on demand) runs `ragkv serve --replicas` on Ray Serve, the Auto Scaling group's g5 instances are its workers (one engine replica per GPU), and each request goes to the replica holding its chunks. The load balancer, when created, forwards gRPC and HTTP to Ray Serve's proxies."
  type        = bool
  default     = false
}

variable "head_instance_type" {
  description = "Instance type of the Ray head node (ray_cluster); it needs no GPU."
  type        = string
  default     = "m6i.2xlarge"
}

variable "ray_replicas" {
  description = "Engine replicas of the Ray cluster: one per worker GPU (asg_desired_capacity on g5.xlarge)."
  type        = number
  default     = 2
}

variable "ray_routing" {
  description = "How the Ray cluster routes requests: chunk (by the chunks each replica holds) or pow2."
  type        = string
  default     = "chunk"
}

variable "ray_object_store_bytes" {
  description = "Bytes of Ray's object store on each Ray node (at most 7 GiB): the replicas' peer tier lives there."
  type        = number
  default     = 4294967296
}

variable "ray_peer_tier_bytes" {
  description = "Bytes of chunk KV each engine replica publishes for its peers (`ragkv serve --peer-tier-bytes`); 0 = the peer tier off."
  type        = number
  default     = 2147483648
}

variable "http_port" {
  description = "Port of the OpenAI-compatible HTTP API in a Ray cluster (Ray Serve's HTTP proxy)."
  type        = number
  default     = 8000
}

# --- Indexing ---

variable "enable_indexing" {
  description = "Create the Spot Batch indexing tier."
  type        = bool
  default     = false
}

variable "batch_service_role_arn" {
  description = "IAM role AWS Batch uses to manage the compute environment. Null uses the AWSServiceRoleForBatch service-linked role."
  type        = string
  default     = null
}

variable "index_instance_types" {
  description = "GPU instance types for the Spot compute environment."
  type        = list(string)
  default     = ["g5.xlarge", "g5.2xlarge", "g6.xlarge", "g6.2xlarge", "g4dn.xlarge", "g4dn.2xlarge"]
}

variable "index_max_vcpus" {
  description = "Upper bound on vCPUs of the Spot compute environment."
  type        = number
  default     = 64
}

variable "corpus_s3_uri" {
  description = "S3 URI of the corpus to index. Null uses s3://{kv bucket}/corpus."
  type        = string
  default     = null
}

variable "index_retry_attempts" {
  description = "Attempts per indexing job on host reclamation or the interruption exit code."
  type        = number
  default     = 5
}
