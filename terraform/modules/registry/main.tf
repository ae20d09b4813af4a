# The container registry of the deployment: one ECR repository for the image
# built from the repository's Dockerfile. The Batch jobs run that image and the
# serving hosts pull it, so every host runs exactly what was built and pushed,
# never a package that a public index resolves by name on the host.

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

resource "aws_ecr_lifecycle_policy" "ragkv" {
  repository = aws_ecr_repository.ragkv.name

  policy = jsonencode({
    rules = [{
      rulePriority = 1
      description  = "Keep the ${var.keep_images} most recent images"
      selection = {
        tagStatus   = "any"
        countType   = "imageCountMoreThan"
        countNumber = var.keep_images
      }
      action = { type = "expire" }
    }]
  })
}
