# The container registry of the deployment: one ECR repository for the image
# built from the repository's Dockerfile. The Batch jobs run that image and the
# serving hosts pull it by digest, so every host runs exactly what was built and
# pushed, never a package that a public index resolves by name on the host.

resource "aws_ecr_repository" "ragkv" {
  name = var.name
  # A pushed tag always names the same image: hosts that pull 0.1.0 run what
  # was tested as 0.1.0.
  image_tag_mutability = "IMMUTABLE"
  force_delete         = var.force_delete

  image_scanning_configuration {
    scan_on_push = true
  }

  encryption_configuration {
    encryption_type = "KMS"
  }

  tags = var.tags
}

# Rule order protects what is deployed: an image that matches a rule's tag selection can
# never be expired by a lower-priority rule. Rule 1 selects the protected tags (the deployed
# image_tag, and release tags) with a count no repository reaches, so it expires nothing
# and keeps them from rules 2 and 3; untagged images expire after untagged_days; of the
# rest, the keep_images newest stay.
locals {
  protected_patterns = distinct(concat(var.protected_tags, [for p in var.protected_tag_prefixes : "${p}*"]))
}

resource "aws_ecr_lifecycle_policy" "ragkv" {
  repository = aws_ecr_repository.ragkv.name

  policy = jsonencode({
    rules = concat(
      length(local.protected_patterns) == 0 ? [] : [{
        rulePriority = 1
        description  = "Never expire the deployed image or a release"
        selection = {
          tagStatus      = "tagged"
          tagPatternList = local.protected_patterns
          countType      = "imageCountMoreThan"
          countNumber    = 10000
        }
        action = { type = "expire" }
      }],
      [
        {
          rulePriority = 2
          description  = "Expire untagged images after ${var.untagged_days} days"
          selection = {
            tagStatus   = "untagged"
            countType   = "sinceImagePushed"
            countUnit   = "days"
            countNumber = var.untagged_days
          }
          action = { type = "expire" }
        },
        {
          rulePriority = 3
          description  = "Keep the ${var.keep_images} most recent of the other images"
          selection = {
            tagStatus   = "any"
            countType   = "imageCountMoreThan"
            countNumber = var.keep_images
          }
          action = { type = "expire" }
        },
      ],
    )
  })
}
