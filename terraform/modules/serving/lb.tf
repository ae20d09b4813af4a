# Optional Network Load Balancer. NLB health checks cannot speak gRPC, so
# each instance runs a small HTTP bridge (templates/grpc_health_http.py) that
# calls grpc.health.v1.Health/Check on the local server and answers 200 only
# while it reports SERVING; the target group checks that bridge. In a Ray
# cluster the targets are Ray Serve's proxies on every node (gRPC and HTTP),
# checked at the HTTP proxy's /-/healthz.
#
# The listeners terminate TLS (certificate_arn, ssl_policy: TLS 1.2 and 1.3 only) and
# forward to the targets inside the VPC; a plaintext TCP listener exists only where
# allow_plaintext_listeners opts into it.

locals {
  listener_protocol = var.allow_plaintext_listeners ? "TCP" : "TLS"
  listener_tls      = local.listener_protocol == "TLS"

  lb_client_ports = merge({ grpc = var.grpc_port }, var.ray_cluster ? { http = var.http_port } : {})
  health_check = var.ray_cluster ? { port = var.http_port, path = "/-/healthz" } : {
    port = var.health_port, path = "/grpc.health.v1.Health/Check"
  }
}

resource "aws_security_group" "lb" {
  count = var.create_load_balancer ? 1 : 0

  name_prefix = "${var.name}-lb-"
  description = "ragkv load balancer: gRPC from named clients only"
  vpc_id      = var.vpc_id

  tags = merge(var.tags, { Name = "${var.name}-lb" })

  lifecycle {
    create_before_destroy = true
  }
}

resource "aws_vpc_security_group_ingress_rule" "lb_cidr" {
  for_each = !var.create_load_balancer ? {} : merge([
    for port_name, port in local.lb_client_ports : {
      for i, cidr in var.allowed_cidrs : "${port_name}-cidr-${i}" => { port = port, cidr = cidr, what = port_name }
    }
  ]...)

  security_group_id = aws_security_group.lb[0].id
  description       = "ragkv ${each.value.what} from ${each.value.cidr}"
  ip_protocol       = "tcp"
  from_port         = each.value.port
  to_port           = each.value.port
  cidr_ipv4         = each.value.cidr

  tags = var.tags
}

resource "aws_vpc_security_group_ingress_rule" "lb_sg" {
  for_each = !var.create_load_balancer ? {} : merge([
    for port_name, port in local.lb_client_ports : {
      for i, sg in var.allowed_security_group_ids : "${port_name}-sg-${i}" => { port = port, sg = sg, what = port_name }
    }
  ]...)

  security_group_id            = aws_security_group.lb[0].id
  description                  = "ragkv ${each.value.what} from a client security group"
  ip_protocol                  = "tcp"
  from_port                    = each.value.port
  to_port                      = each.value.port
  referenced_security_group_id = each.value.sg

  tags = var.tags
}

resource "aws_vpc_security_group_egress_rule" "lb_to_instances" {
  for_each = local.lb_ports

  security_group_id            = aws_security_group.lb[0].id
  description                  = "ragkv ${each.key} to the serving instances"
  ip_protocol                  = "tcp"
  from_port                    = each.value
  to_port                      = each.value
  referenced_security_group_id = aws_security_group.serving.id

  tags = var.tags
}

resource "aws_lb" "serving" {
  count = var.create_load_balancer ? 1 : 0

  name_prefix                      = "rkv-"
  load_balancer_type               = "network"
  internal                         = var.load_balancer_internal
  subnets                          = var.subnet_ids
  security_groups                  = [aws_security_group.lb[0].id]
  enable_cross_zone_load_balancing = true
  enable_deletion_protection       = var.load_balancer_deletion_protection

  dynamic "access_logs" {
    for_each = var.load_balancer_access_log_bucket == null ? [] : [var.load_balancer_access_log_bucket]

    content {
      bucket  = access_logs.value
      prefix  = "${var.name}-nlb"
      enabled = true
    }
  }

  tags = var.tags
}

resource "aws_lb_target_group" "grpc" {
  count = var.create_load_balancer ? 1 : 0

  name_prefix          = "rkv-"
  vpc_id               = var.vpc_id
  port                 = var.grpc_port
  protocol             = "TCP"
  target_type          = "instance"
  deregistration_delay = 60

  health_check {
    enabled             = true
    protocol            = "HTTP"
    port                = tostring(local.health_check.port)
    path                = local.health_check.path
    matcher             = "200"
    interval            = 10
    healthy_threshold   = 2
    unhealthy_threshold = 2
  }

  tags = var.tags
}

resource "aws_lb_listener" "grpc" {
  count = var.create_load_balancer ? 1 : 0

  load_balancer_arn = aws_lb.serving[0].arn
  port              = var.grpc_port
  protocol          = local.listener_protocol
  certificate_arn   = local.listener_tls ? var.certificate_arn : null
  ssl_policy        = local.listener_tls ? var.ssl_policy : null
  # gRPC is HTTP/2: clients negotiate h2 through ALPN.
  alpn_policy = local.listener_tls ? "HTTP2Preferred" : null

  default_action {
    type             = "forward"
    target_group_arn = aws_lb_target_group.grpc[0].arn
  }

  tags = var.tags
}

resource "aws_lb_target_group_attachment" "standalone" {
  count = var.create_load_balancer ? local.standalone_count : 0

  target_group_arn = aws_lb_target_group.grpc[0].arn
  target_id        = aws_instance.serving[count.index].id
  port             = var.grpc_port
}

# A Ray cluster's OpenAI-compatible HTTP API, through Ray Serve's HTTP proxies.
resource "aws_lb_target_group" "http" {
  count = var.create_load_balancer && var.ray_cluster ? 1 : 0

  name_prefix          = "rkvh-"
  vpc_id               = var.vpc_id
  port                 = var.http_port
  protocol             = "TCP"
  target_type          = "instance"
  deregistration_delay = 60

  health_check {
    enabled             = true
    protocol            = "HTTP"
    port                = tostring(var.http_port)
    path                = "/-/healthz"
    matcher             = "200"
    interval            = 10
    healthy_threshold   = 2
    unhealthy_threshold = 2
  }

  tags = var.tags
}

resource "aws_lb_listener" "http" {
  count = var.create_load_balancer && var.ray_cluster ? 1 : 0

  load_balancer_arn = aws_lb.serving[0].arn
  port              = var.http_port
  protocol          = local.listener_protocol
  certificate_arn   = local.listener_tls ? var.certificate_arn : null
  ssl_policy        = local.listener_tls ? var.ssl_policy : null
  alpn_policy       = local.listener_tls ? "HTTP2Optional" : null

  default_action {
    type             = "forward"
    target_group_arn = aws_lb_target_group.http[0].arn
  }

  tags = var.tags
}

# The head node's proxies serve too (the workers join through the Auto Scaling group).
resource "aws_lb_target_group_attachment" "head" {
  for_each = var.create_load_balancer && var.ray_cluster ? {
    grpc = { arn = aws_lb_target_group.grpc[0].arn, port = var.grpc_port }
    http = { arn = aws_lb_target_group.http[0].arn, port = var.http_port }
  } : {}

  target_group_arn = each.value.arn
  target_id        = aws_instance.ray_head[0].id
  port             = each.value.port
}
