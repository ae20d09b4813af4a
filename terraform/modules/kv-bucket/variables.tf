variable "name" {
  description = "Name prefix for the bucket, KMS key alias and rule ids."
  type        = string

  validation {
    condition     = can(regex("^[a-z0-9][a-z0-9-]{1,30}[a-z0-9]$", var.name))
    error_message = "name must be 3-32 characters of lowercase letters, digits and hyphens (it becomes part of an S3 bucket name)."
  }
}

variable "bucket_name" {
  description = "Exact bucket name. Null derives a unique name from var.name with bucket_prefix."
  type        = string
  default     = null
}

variable "kv_prefix" {
  description = "Key prefix under which KV files live: objects are {kv_prefix}/{model_fp}/{key[:2]}/{key}.safetensors."
  type        = string
  default     = "kv"

  validation {
    condition     = can(regex("^[A-Za-z0-9._-]+(/[A-Za-z0-9._-]+)*$", var.kv_prefix))
    error_message = "kv_prefix must be a relative key prefix without leading or trailing slashes, e.g. \"kv\" or \"prod/kv\"."
  }
}

variable "index_prefix" {
  description = "Key prefix under which built FAISS indexes (one folder per index version) live."
  type        = string
  default     = "index"

  validation {
    condition     = can(regex("^[A-Za-z0-9._-]+(/[A-Za-z0-9._-]+)*$", var.index_prefix))
    error_message = "index_prefix must be a relative key prefix without leading or trailing slashes."
  }
}

variable "expired_prefixes" {
  description = "Key prefixes of retired index versions (e.g. \"kv/3f2a9c\" for an old model fingerprint, or \"index/v1\"); their objects expire after expired_prefix_days."
  type        = list(string)
  default     = []

  validation {
    condition     = alltrue([for p in var.expired_prefixes : can(regex("^[A-Za-z0-9._-]+(/[A-Za-z0-9._-]+)*$", p))])
    error_message = "Each expired prefix must be a non-empty relative key prefix without leading or trailing slashes (an empty prefix would expire the whole bucket)."
  }
}

variable "expired_prefix_days" {
  description = "Days after which objects under an expired prefix are deleted."
  type        = number
  default     = 1

  validation {
    condition     = var.expired_prefix_days >= 1
    error_message = "expired_prefix_days must be at least 1."
  }
}

variable "abort_incomplete_multipart_days" {
  description = "Days after which incomplete multipart uploads (e.g. from a reclaimed Spot indexer) are aborted."
  type        = number
  default     = 1

  validation {
    condition     = var.abort_incomplete_multipart_days >= 1
    error_message = "abort_incomplete_multipart_days must be at least 1."
  }
}

variable "noncurrent_version_days" {
  description = "Days a noncurrent (overwritten or deleted) object version is kept before it is deleted."
  type        = number
  default     = 7

  validation {
    condition     = var.noncurrent_version_days >= 1
    error_message = "noncurrent_version_days must be at least 1."
  }
}

variable "access_log_bucket" {
  description = "Existing bucket that receives S3 server access logs. Null disables access logging."
  type        = string
  default     = null
}

variable "kms_deletion_window_days" {
  description = "Waiting period in days before the KMS key is deleted after destroy."
  type        = number
  default     = 30

  validation {
    condition     = var.kms_deletion_window_days >= 7 && var.kms_deletion_window_days <= 30
    error_message = "kms_deletion_window_days must be between 7 and 30."
  }
}

variable "force_destroy" {
  description = "Allow destroy to delete a non-empty bucket. Keep false in production."
  type        = bool
  default     = false
}

variable "tags" {
  description = "Tags added to every taggable resource."
  type        = map(string)
  default     = {}
}
