variable "name" {
  description = "Name prefix for every resource of the indexing tier."
  type        = string
}

variable "tags" {
  description = "Tags added to every taggable resource (and propagated to Batch jobs and their instances)."
  type        = map(string)
  default     = {}
}

variable "vpc_id" {
  description = "VPC for the Batch compute environment's security group."
  type        = string
}

variable "subnet_ids" {
  description = "Subnets where Batch launches Spot instances; several availability zones widen the Spot pools."
  type        = list(string)

  validation {
    condition     = length(var.subnet_ids) > 0
    error_message = "subnet_ids must name at least one subnet."
  }
}

variable "container_image" {
  description = "Image that runs `ragkv index` (built from the repository's Dockerfile), pinned by digest: REGISTRY/NAME[:TAG]@sha256:DIGEST, e.g. 123456789012.dkr.ecr.us-east-1.amazonaws.com/ragkv:0.1.0@sha256:... The digest is what the jobs pull; the tag only names it."
  type        = string

  validation {
    condition     = can(regex("^[^@\\s]+@sha256:[0-9a-f]{64}$", var.container_image))
    error_message = "container_image must be pinned by digest, REGISTRY/NAME[:TAG]@sha256:DIGEST (the root module: set image_digest to the pushed image_tag's digest): a job runs exactly the image that was built and pushed, not whatever the tag names when it starts."
  }
}

variable "service_role_arn" {
  description = "IAM role AWS Batch uses to manage the compute environment. Null uses the AWSServiceRoleForBatch service-linked role."
  type        = string
  default     = null
}

variable "instance_types" {
  description = "GPU instance types the Spot compute environment may launch. More types mean more Spot pools and fewer interruptions."
  type        = list(string)
  default     = ["g5.xlarge", "g5.2xlarge", "g6.xlarge", "g6.2xlarge", "g4dn.xlarge", "g4dn.2xlarge"]

  validation {
    condition     = length(var.instance_types) >= 2
    error_message = "Name at least two instance types: a single Spot pool is interrupted far more often."
  }
}

variable "max_vcpus" {
  description = "Upper bound on the vCPUs the compute environment runs at once (caps cost and parallel shards)."
  type        = number
  default     = 64
}

variable "ec2_image_type" {
  description = "Batch AMI family for the instances; it must be a GPU variant. ECS_AL2023_NVIDIA by default: Amazon Linux 2 reached end of support on 2026-06-30."
  type        = string
  default     = "ECS_AL2023_NVIDIA"

  validation {
    condition     = contains(["ECS_AL2_NVIDIA", "ECS_AL2023_NVIDIA"], var.ec2_image_type)
    error_message = "ec2_image_type must be ECS_AL2_NVIDIA or ECS_AL2023_NVIDIA (a GPU AMI)."
  }
}

variable "root_volume_size_gb" {
  description = "Size of the instances' encrypted gp3 root volume in GiB (container images with CUDA are large)."
  type        = number
  default     = 200
}

variable "root_device_name" {
  description = "Root device name of the Batch ECS AMI."
  type        = string
  default     = "/dev/xvda"
}

variable "job_vcpus" {
  description = "vCPUs reserved per indexing job."
  type        = number
  default     = 4
}

variable "job_memory_mib" {
  description = "Memory reserved per indexing job in MiB (below the smallest instance's memory minus the ECS agent's share)."
  type        = number
  default     = 14336
}

variable "job_gpus" {
  description = "GPUs per indexing job."
  type        = number
  default     = 1

  validation {
    condition     = var.job_gpus >= 1
    error_message = "The indexing job needs at least one GPU."
  }
}

variable "merge_vcpus" {
  description = "vCPUs reserved for the merge job."
  type        = number
  default     = 2
}

variable "merge_memory_mib" {
  description = "Memory reserved for the merge job in MiB."
  type        = number
  default     = 8192
}

variable "retry_attempts" {
  description = "Attempts per job (or per array child) when the host is reclaimed or the indexer exits with the interruption code."
  type        = number
  default     = 5

  validation {
    condition     = var.retry_attempts >= 2 && var.retry_attempts <= 10
    error_message = "retry_attempts must be between 2 and 10 (Batch's limit)."
  }
}

variable "interruption_exit_code" {
  description = "Exit code of `ragkv index` after a Spot notice or SIGTERM, once it has checkpointed (EX_TEMPFAIL)."
  type        = number
  default     = 75
}

variable "stop_timeout_seconds" {
  description = "Seconds ECS waits between SIGTERM and SIGKILL when it stops a job's container; the indexer checkpoints in this window (a Spot notice gives 120 in all)."
  type        = number
  default     = 100

  validation {
    condition     = var.stop_timeout_seconds >= 10 && var.stop_timeout_seconds <= 115
    error_message = "stop_timeout_seconds must be between 10 and 115: the instance is gone 120 s after the Spot notice."
  }
}

variable "job_timeout_seconds" {
  description = "Wall-clock limit per job attempt in seconds."
  type        = number
  default     = 86400
}

variable "shard_count" {
  description = "Default number of shards (the array size). Override SHARD_COUNT at submit time together with --array-properties size=N."
  type        = number
  default     = 1

  validation {
    condition     = var.shard_count >= 1 && var.shard_count <= 10000
    error_message = "shard_count must be between 1 and 10000 (Batch's array size limit)."
  }
}

variable "corpus_s3_uri" {
  description = "S3 URI of the corpus to index (read-only). Null uses s3://{kv bucket}/corpus."
  type        = string
  default     = null

  validation {
    condition     = var.corpus_s3_uri == null || can(regex("^s3://[a-z0-9][a-z0-9.-]+[a-z0-9](/.*)?$", var.corpus_s3_uri))
    error_message = "corpus_s3_uri must look like s3://bucket/prefix."
  }
}

variable "corpus_kms_key_arn" {
  description = "KMS key that encrypts the corpus, when it lives outside the KV bucket under a different key. Null adds no grant."
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
  description = "Key prefix of the KV files; the jobs may read and write only under it (and under index_prefix)."
  type        = string
  default     = "kv"
}

variable "index_prefix" {
  description = "Key prefix of the built indexes."
  type        = string
  default     = "index"
}

variable "index_version" {
  description = "The index version the jobs write, s3://{bucket}/{index_prefix}/{index_version}: their role may write under it alone (not other versions), so a new version is a new apply with this set."
  type        = string
  default     = "latest"
}

variable "index_command" {
  description = "Shell command of the indexing job (run by sh -c; exec keeps SIGTERM reaching ragkv). Batch sets AWS_BATCH_JOB_ARRAY_INDEX for array children."
  type        = string
  default     = "exec ragkv index \"$CORPUS_URI\" --out \"$INDEX_OUT_URI\" --kv-store \"$RAGKV_KV_S3_URI\" --shard \"$${AWS_BATCH_JOB_ARRAY_INDEX:-0}/$${SHARD_COUNT:-1}\""
}

variable "merge_command" {
  description = "Shell command of the merge job that runs after every shard has finished."
  type        = string
  default     = "exec ragkv index merge --out \"$INDEX_OUT_URI\""
}

variable "environment" {
  description = "Extra environment for both jobs (RAGKV_... settings)."
  type        = map(string)
  default     = {}
}

variable "enable_ssm" {
  description = "Let operators reach the Batch instances through Session Manager for debugging: an inline policy with the agent's own actions only (not AmazonSSMManagedInstanceCore, which may read every SSM parameter in the account)."
  type        = bool
  default     = false
}
