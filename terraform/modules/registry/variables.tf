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
  description = "Number of most recent images the lifecycle policy keeps; older ones expire."
  type        = number
  default     = 20

  validation {
    condition     = var.keep_images >= 1
    error_message = "keep_images must be at least 1."
  }
}
