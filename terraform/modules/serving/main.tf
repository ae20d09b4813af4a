# The serving tier: GPU instances that run `ragkv serve` under systemd, with
# the local NVMe instance store as the disk tier and the KV bucket as the
# durable tier. Standalone instances by default; an Auto Scaling group and a
# Network Load Balancer for several replicas are optional. With ray_cluster the
# same instances form a Ray cluster instead: a head node runs `ragkv serve
# --replicas` (Ray Serve), the Auto Scaling group's GPU instances are its workers,
# and requests are routed by the chunks each replica holds.

data "aws_partition" "current" {}
data "aws_region" "current" {}
data "aws_caller_identity" "current" {}

data "aws_ssm_parameter" "ami" {
  count = var.ami_id == null ? 1 : 0
  name  = var.ami_ssm_parameter
}

locals {
  ami_id = var.ami_id != null ? var.ami_id : data.aws_ssm_parameter.ami[0].insecure_value

  kv_s3_uri    = "s3://${var.kv_bucket_name}/${var.kv_prefix}"
  index_s3_uri = "s3://${var.kv_bucket_name}/${var.index_prefix}/${var.index_version}"

  user_data = templatefile("${path.module}/templates/user_data.sh.tftpl", {
    image         = var.container_image
    registry      = split("/", var.container_image)[0]
    grpc_port     = var.grpc_port
    metrics_port  = var.metrics_port
    health_port   = var.health_port
    region        = data.aws_region.current.name
    kv_s3_uri     = local.kv_s3_uri
    index_s3_uri  = local.index_s3_uri
    environment   = var.environment
    health_bridge = file("${path.module}/templates/grpc_health_http.py")
  })

  # A Ray cluster: the head's and the workers' user data (templates/ray_node.sh.tftpl).
  token_parameter = "/${var.name}/ray-auth-token"
  ray_node = {
    image           = var.container_image
    registry        = split("/", var.container_image)[0]
    region          = data.aws_region.current.name
    kv_s3_uri       = local.kv_s3_uri
    index_s3_uri    = local.index_s3_uri
    environment     = var.environment
    token_parameter = local.token_parameter
    ray_port        = var.ray_port
    replicas        = var.ray_replicas
    routing         = var.ray_routing
    grpc_port       = var.grpc_port
    http_port       = var.http_port
    metrics_port    = var.metrics_port
    ray_ports       = local.ray_ports_flags
  }
  # Ray's ports, fixed on every node so the security group names them (not every port):
  # GCS, node manager, object manager, dashboard agent (gRPC, HTTP), metrics, runtime env
  # agent, then the workers' range.
  ray_fixed_ports = {
    node_manager           = var.ray_port + 1, object_manager = var.ray_port + 2, dashboard_agent_grpc = var.ray_port + 3,
    dashboard_agent_listen = var.ray_port + 4, metrics_export = var.ray_port + 5, runtime_env_agent = var.ray_port + 6,
  }
  ray_port_ranges = {
    gcs_and_agents = { from = var.ray_port, to = var.ray_port + 6 }
    workers        = { from = 10002, to = 19999 }
  }
  ray_ports_flags = join(" ", concat(
    [for name, port in local.ray_fixed_ports : "--${replace(name, "_", "-")}-port ${port}"],
    ["--min-worker-port 10002", "--max-worker-port 19999"],
  ))
  head_user_data = templatefile("${path.module}/templates/ray_node.sh.tftpl", merge(local.ray_node, {
    role = "head", head_address = ""
  }))
  worker_user_data = var.ray_cluster ? templatefile("${path.module}/templates/ray_node.sh.tftpl", merge(local.ray_node, {
    role = "worker", head_address = aws_instance.ray_head[0].private_ip
  })) : ""

  use_asg          = var.create_autoscaling_group || var.ray_cluster
  standalone_count = local.use_asg ? 0 : var.instance_count

  # Ingress to the instances: gRPC and metrics from the named CIDRs and
  # security groups; gRPC and the health bridge from the load balancer.
  # Keys are indexes, not values, so ids unknown at plan time still work.
  client_ports = merge({ grpc = var.grpc_port, metrics = var.metrics_port }, var.ray_cluster ? { http = var.http_port } : {})
  cidr_ingress = merge([
    for port_name, port in local.client_ports : {
      for i, cidr in var.allowed_cidrs : "${port_name}-cidr-${i}" => { port = port, cidr = cidr, what = port_name }
    }
  ]...)
  sg_ingress = merge([
    for port_name, port in local.client_ports : {
      for i, sg in var.allowed_security_group_ids : "${port_name}-sg-${i}" => { port = port, sg = sg, what = port_name }
    }
  ]...)
  lb_ports = !var.create_load_balancer ? {} : (
    var.ray_cluster ? { grpc = var.grpc_port, http = var.http_port } : { grpc = var.grpc_port, health = var.health_port }
  )
}

# --- IAM: least privilege on the KV prefix, read-only on the index prefix ---

resource "aws_iam_role" "serving" {
  name_prefix = "${var.name}-serving-"
  description = "ragkv serving instances"

  assume_role_policy = jsonencode({
    Version = "2012-10-17"
    Statement = [{
      Effect    = "Allow"
      Principal = { Service = "ec2.amazonaws.com" }
      Action    = "sts:AssumeRole"
    }]
  })

  tags = var.tags
}

resource "aws_iam_role_policy" "kv_access" {
  name = "ragkv-kv-access"
  role = aws_iam_role.serving.id

  policy = jsonencode({
    Version = "2012-10-17"
    Statement = concat([
      {
        # DeleteObject: the S3 tier deletes an object that fails verification
        # (and `delete` removes one), so a later put can replace it.
        Sid      = "ReadWriteKV"
        Effect   = "Allow"
        Action   = ["s3:GetObject", "s3:PutObject", "s3:AbortMultipartUpload", "s3:DeleteObject"]
        Resource = "${var.kv_bucket_arn}/${var.kv_prefix}/*"
      },
      {
        Sid      = "ReadIndex"
        Effect   = "Allow"
        Action   = ["s3:GetObject"]
        Resource = "${var.kv_bucket_arn}/${var.index_prefix}/*"
      },
      {
        # Unconditional: without s3:ListBucket S3 answers a missing key with 403,
        # not 404, and every KV miss would be logged and counted as an error.
        Sid      = "ListBucket"
        Effect   = "Allow"
        Action   = ["s3:ListBucket"]
        Resource = var.kv_bucket_arn
      },
      {
        Sid      = "UseBucketKey"
        Effect   = "Allow"
        Action   = ["kms:Decrypt", "kms:GenerateDataKey"]
        Resource = var.kms_key_arn
      },
      {
        Sid      = "PullImage"
        Effect   = "Allow"
        Action   = ["ecr:BatchGetImage", "ecr:GetDownloadUrlForLayer", "ecr:BatchCheckLayerAvailability"]
        Resource = var.ecr_repository_arn
      },
      {
        # `docker login` to ECR; this action takes no resource but "*".
        Sid      = "RegistryLogin"
        Effect   = "Allow"
        Action   = ["ecr:GetAuthorizationToken"]
        Resource = "*"
      },
      ], var.ray_cluster ? [{
        # The Ray cluster's token: the head writes it once, every node reads it.
        Sid      = "RayToken"
        Effect   = "Allow"
        Action   = ["ssm:GetParameter", "ssm:PutParameter"]
        Resource = "arn:${data.aws_partition.current.partition}:ssm:${data.aws_region.current.name}:${data.aws_caller_identity.current.account_id}:parameter${local.token_parameter}"
    }] : [])
  })
}

resource "aws_iam_role_policy_attachment" "ssm" {
  count      = var.enable_ssm ? 1 : 0
  role       = aws_iam_role.serving.name
  policy_arn = "arn:${data.aws_partition.current.partition}:iam::aws:policy/AmazonSSMManagedInstanceCore"
}

resource "aws_iam_instance_profile" "serving" {
  name_prefix = "${var.name}-serving-"
  role        = aws_iam_role.serving.name

  tags = var.tags
}

# --- Network ---

resource "aws_security_group" "serving" {
  name_prefix = "${var.name}-serving-"
  description = "ragkv serving instances: gRPC and metrics from named clients only"
  vpc_id      = var.vpc_id

  tags = merge(var.tags, { Name = "${var.name}-serving" })

  lifecycle {
    create_before_destroy = true
  }
}

resource "aws_vpc_security_group_ingress_rule" "cidr" {
  for_each = local.cidr_ingress

  security_group_id = aws_security_group.serving.id
  description       = "ragkv ${each.value.what} from ${each.value.cidr}"
  ip_protocol       = "tcp"
  from_port         = each.value.port
  to_port           = each.value.port
  cidr_ipv4         = each.value.cidr

  tags = var.tags
}

resource "aws_vpc_security_group_ingress_rule" "sg" {
  for_each = local.sg_ingress

  security_group_id            = aws_security_group.serving.id
  description                  = "ragkv ${each.value.what} from a client security group"
  ip_protocol                  = "tcp"
  from_port                    = each.value.port
  to_port                      = each.value.port
  referenced_security_group_id = each.value.sg

  tags = var.tags
}

resource "aws_vpc_security_group_ingress_rule" "from_lb" {
  for_each = local.lb_ports

  security_group_id            = aws_security_group.serving.id
  description                  = "ragkv ${each.key} from the load balancer"
  ip_protocol                  = "tcp"
  from_port                    = each.value
  to_port                      = each.value
  referenced_security_group_id = aws_security_group.lb[0].id

  tags = var.tags
}

# A Ray cluster's nodes talk to each other on Ray's ports (GCS, node and object managers,
# agents, workers): only inside this security group, never from a client CIDR.
resource "aws_vpc_security_group_ingress_rule" "ray_internal" {
  for_each = var.ray_cluster ? local.ray_port_ranges : {}

  security_group_id            = aws_security_group.serving.id
  description                  = "Ray ${each.key} between the cluster's nodes"
  ip_protocol                  = "tcp"
  from_port                    = each.value.from
  to_port                      = each.value.to
  referenced_security_group_id = aws_security_group.serving.id

  tags = var.tags
}

resource "aws_vpc_security_group_egress_rule" "ray_internal" {
  for_each = var.ray_cluster ? local.ray_port_ranges : {}

  security_group_id            = aws_security_group.serving.id
  description                  = "Ray ${each.key} between the cluster's nodes"
  ip_protocol                  = "tcp"
  from_port                    = each.value.from
  to_port                      = each.value.to
  referenced_security_group_id = aws_security_group.serving.id

  tags = var.tags
}

resource "aws_vpc_security_group_egress_rule" "serving" {
  for_each = { for pair in setproduct([80, 443], var.egress_cidrs) : "${pair[0]}-${pair[1]}" => { port = pair[0], cidr = pair[1] } }

  security_group_id = aws_security_group.serving.id
  description       = "HTTP(S) to S3, KMS, SSM and package mirrors"
  ip_protocol       = "tcp"
  from_port         = each.value.port
  to_port           = each.value.port
  cidr_ipv4         = each.value.cidr

  tags = var.tags
}

# --- Instances ---

resource "aws_instance" "serving" {
  count = local.standalone_count

  ami                    = local.ami_id
  instance_type          = var.instance_type
  subnet_id              = var.subnet_ids[count.index % length(var.subnet_ids)]
  vpc_security_group_ids = [aws_security_group.serving.id]
  iam_instance_profile   = aws_iam_instance_profile.serving.name
  ebs_optimized          = true
  monitoring             = var.detailed_monitoring
  user_data_base64       = base64gzip(local.user_data)
  # User data runs on first boot only: a new image or index_version needs a
  # new instance (a stop and start would keep the old settings and wipe the
  # NVMe tier anyway).
  user_data_replace_on_change = true

  metadata_options {
    http_endpoint               = "enabled"
    http_tokens                 = "required"
    http_put_response_hop_limit = 1
    instance_metadata_tags      = "disabled"
  }

  root_block_device {
    volume_type           = "gp3"
    volume_size           = var.root_volume_size_gb
    encrypted             = true
    kms_key_id            = var.root_volume_kms_key_id
    delete_on_termination = true
    tags                  = var.tags
  }

  tags = merge(var.tags, { Name = "${var.name}-serving-${count.index}" })

  lifecycle {
    # The SSM parameter moves to each new AMI release; replacing a serving
    # instance must be a deliberate act (taint it, or use the ASG's refresh).
    ignore_changes = [ami]
  }
}

resource "aws_instance" "ray_head" {
  count = var.ray_cluster ? 1 : 0

  ami                         = local.ami_id
  instance_type               = var.head_instance_type
  subnet_id                   = var.subnet_ids[0]
  vpc_security_group_ids      = [aws_security_group.serving.id]
  iam_instance_profile        = aws_iam_instance_profile.serving.name
  ebs_optimized               = true
  monitoring                  = var.detailed_monitoring
  user_data_base64            = base64gzip(local.head_user_data)
  user_data_replace_on_change = true

  metadata_options {
    http_endpoint               = "enabled"
    http_tokens                 = "required"
    http_put_response_hop_limit = 1
    instance_metadata_tags      = "disabled"
  }

  root_block_device {
    volume_type           = "gp3"
    volume_size           = var.root_volume_size_gb
    encrypted             = true
    kms_key_id            = var.root_volume_kms_key_id
    delete_on_termination = true
    tags                  = var.tags
  }

  tags = merge(var.tags, { Name = "${var.name}-ray-head" })

  lifecycle {
    ignore_changes = [ami]
  }
}

resource "aws_launch_template" "serving" {
  count = local.use_asg ? 1 : 0

  name_prefix            = "${var.name}-serving-"
  description            = "ragkv serving replicas"
  image_id               = local.ami_id
  instance_type          = var.instance_type
  vpc_security_group_ids = [aws_security_group.serving.id]
  ebs_optimized          = true
  user_data              = base64gzip(var.ray_cluster ? local.worker_user_data : local.user_data)
  update_default_version = true

  iam_instance_profile {
    arn = aws_iam_instance_profile.serving.arn
  }

  metadata_options {
    http_endpoint               = "enabled"
    http_tokens                 = "required"
    http_put_response_hop_limit = 1
    instance_metadata_tags      = "disabled"
  }

  monitoring {
    enabled = var.detailed_monitoring
  }

  block_device_mappings {
    device_name = var.root_device_name

    ebs {
      volume_type           = "gp3"
      volume_size           = var.root_volume_size_gb
      encrypted             = true
      kms_key_id            = var.root_volume_kms_key_id
      delete_on_termination = true
    }
  }

  dynamic "tag_specifications" {
    for_each = ["instance", "volume", "network-interface"]

    content {
      resource_type = tag_specifications.value
      tags          = merge(var.tags, { Name = "${var.name}-serving" })
    }
  }

  tags = var.tags
}

resource "aws_autoscaling_group" "serving" {
  count = local.use_asg ? 1 : 0

  name_prefix               = "${var.name}-serving-"
  vpc_zone_identifier       = var.subnet_ids
  min_size                  = var.asg_min_size
  max_size                  = var.asg_max_size
  desired_capacity          = var.asg_desired_capacity
  health_check_type         = var.create_load_balancer ? "ELB" : "EC2"
  health_check_grace_period = var.health_check_grace_period
  target_group_arns         = concat(aws_lb_target_group.grpc[*].arn, aws_lb_target_group.http[*].arn)

  launch_template {
    id      = aws_launch_template.serving[0].id
    version = aws_launch_template.serving[0].latest_version
  }

  instance_refresh {
    strategy = "Rolling"

    preferences {
      min_healthy_percentage = 50
    }
  }

  dynamic "tag" {
    for_each = merge(var.tags, { Name = "${var.name}-serving" })

    content {
      key                 = tag.key
      value               = tag.value
      propagate_at_launch = true
    }
  }
}
