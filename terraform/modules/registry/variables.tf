variable "name" {
  description = "Name of the ECR repository (lowercase letters, digits, hyphens, '/' for namespaces)."
  type        = string
}

variable "tags" {
  description = "Tags added to every taggable resource."
  type        = map(string)
  default     = {}
}

variable "force_delete" {
  description = "Allow destroy to delete the repository while it still holds images (for short-lived environments)."
  type        = bool
  default     = false
}

variable "keep_images" {
  description = "Number of most recent images the lifecycle policy keeps among those neither protected (protected_tags, protected_tag_prefixes) nor untagged; older ones expire."
  type        = number
  default     = 20

  validation {
    condition     = var.keep_images >= 1
    error_message = "keep_images must be at least 1."
  }
}

variable "protected_tags" {
  description = "Tags (exact, or ECR patterns with '*') whose images the lifecycle policy never expires: the deployed image_tag, so the image the hosts pull by digest cannot be expired under them."
  type        = list(string)
  default     = []

  validation {
    condition     = alltrue([for t in var.protected_tags : can(regex("^[A-Za-z0-9_.*-]{1,128}$", t)) && length(regexall("\\*", t)) <= 4])
    error_message = "protected_tags entries must be Docker tags or ECR tag patterns (at most four '*')."
  }
}

variable "protected_tag_prefixes" {
  description = "Tag prefixes whose images the lifecycle policy never expires (release builds a rollback may need)."
  type        = list(string)
  default     = ["release-"]

  validation {
    condition     = alltrue([for p in var.protected_tag_prefixes : can(regex("^[A-Za-z0-9_.-]{1,127}$", p))])
    error_message = "protected_tag_prefixes entries must be the start of a Docker tag (letters, digits, '_', '.', '-')."
  }
}

variable "untagged_days" {
  description = "Days after which untagged images (superseded layers of a build, never a deployed image) expire."
  type        = number
  default     = 14

  validation {
    condition     = var.untagged_days >= 1
    error_message = "untagged_days must be at least 1."
  }
}
