# Plan-level checks of the registry module, offline (mock AWS provider).

mock_provider "aws" {}

variables {
  name           = "ragkv-test"
  protected_tags = ["0.3.1"]
  tags           = { Project = "ragkv" }
}

run "lifecycle_never_expires_the_deployed_image" {
  command = plan

  module {
    source = "./modules/registry"
  }

  assert {
    condition     = aws_ecr_repository.ragkv.image_tag_mutability == "IMMUTABLE"
    error_message = "A tag must always name the same image."
  }

  assert {
    # Rule order protects: an image a rule's tag selection matches cannot be expired by a
    # lower-priority rule. The first rule selects the deployed tag and release tags, and its
    # count is one no repository reaches, so it expires nothing itself.
    condition = anytrue([
      for r in jsondecode(aws_ecr_lifecycle_policy.ragkv.policy).rules :
      r.rulePriority == min([for x in jsondecode(aws_ecr_lifecycle_policy.ragkv.policy).rules : x.rulePriority]...)
      && r.selection.tagStatus == "tagged" && contains(try(r.selection.tagPatternList, []), "0.3.1") && contains(try(r.selection.tagPatternList, []), "release-*")
      && r.selection.countType == "imageCountMoreThan" && r.selection.countNumber >= 10000
    ])
    error_message = "The highest-priority rule must select the deployed tag (and release-*) and expire none of them."
  }

  assert {
    condition = alltrue([
      for r in jsondecode(aws_ecr_lifecycle_policy.ragkv.policy).rules :
      r.rulePriority == max([for x in jsondecode(aws_ecr_lifecycle_policy.ragkv.policy).rules : x.rulePriority]...) if r.selection.tagStatus == "any"
    ])
    error_message = "A rule over any tag status must come last (ECR requires it), after the protection."
  }

  assert {
    condition = anytrue([
      for r in jsondecode(aws_ecr_lifecycle_policy.ragkv.policy).rules :
      r.selection.tagStatus == "untagged" && r.selection.countType == "sinceImagePushed"
    ])
    error_message = "Untagged images expire by age."
  }
}
