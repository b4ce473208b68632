"""docker-compose.yml's generated blocks: a service entry per service, and the NATS
server's passwords."""

from __future__ import annotations

from devstack.deploygen.model import PG_DATABASE, WEB_PORT, Deployed
from devstack.deploygen.render import replace_block
from devstack.deploygen.telemetry import TELEMETRY_DEFAULTS
from servicekit.natsconf import password_variable
from servicekit.permissions import ADMIN, USERS

# Every secret is required: compose refuses to start without it rather than fall back to
# a value committed here. `agentbus secrets --write .env` makes them all, mode 0600.
ENV_HINT = ":?run agentbus secrets --write .env"
# The compose Postgres's one user (the image's superuser): only services with a schema get it.
COMPOSE_DATABASE_URL = (
    f"postgresql://agentbus:${{POSTGRES_PASSWORD{ENV_HINT}}}@postgres:5432/{PG_DATABASE}"
)


def compose_nats_env(indent: str = "      ") -> str:
    """The NATS server's environment: every deployed user's password (auth.conf reads them)."""
    lines = [
        f"{password_variable(u)}: ${{{password_variable(u)}{ENV_HINT}}}"
        for u in USERS
        if u != ADMIN
    ]
    return "".join(f"{indent}{line}\n" for line in lines)


def compose_service(s: Deployed) -> str:
    lines = [
        f"{s.dns}:",
        "  <<: *service",
        f'  command: ["{s.module}"]',
        "  environment:",
        "    <<: *service-env",
        f"    NATS_USER: {s.name}",
        f"    NATS_PASSWORD: ${{{password_variable(s.name)}{ENV_HINT}}}",
        # Tracing: off unless .env or the shell sets it (the same defaults as in k8s).
        f"    OTEL_SERVICE_NAME: {s.name}",
        *(f"    {key}: ${{{key}:-{value}}}" for key, value in TELEMETRY_DEFAULTS.items()),
    ]
    if s.schema is not None:
        lines.append(f"    DATABASE_URL: {COMPOSE_DATABASE_URL}")
    if s.provider:
        lines += [
            "    # Unset: it answers from its offline script and says so in its log.",
            "    ANTHROPIC_API_KEY: ${ANTHROPIC_API_KEY:-}",
            "    OPENAI_API_KEY: ${OPENAI_API_KEY:-}",
            "    OPENAI_BASE_URL: ${OPENAI_BASE_URL:-}",
        ]
    if s.web:
        lines += [
            "    AGENTBUS_GATEWAY_HOST: 0.0.0.0",
            f'    AGENTBUS_GATEWAY_PORT: "{WEB_PORT}"',
            "    # Tokens are signed with it (a random one in .env, like the passwords).",
            "    # Mint a token with `docker compose exec gateway agentbus token <project>`.",
            f"    AGENTBUS_GATEWAY_SECRET: ${{AGENTBUS_GATEWAY_SECRET{ENV_HINT}}}",
            "  ports:",
            f'    - "127.0.0.1:${{GATEWAY_PORT:-{WEB_PORT}}}:{WEB_PORT}"',
        ]
    if s.durables:
        lines += [
            "  # A delivery it holds can be a model turn of minutes; JetStream redelivers what",
            "  # a stopped replica held, so a long grace only spares a replayed turn.",
            f"  stop_grace_period: {s.grace_seconds}s",
        ]
    if not s.web:  # one published port cannot serve two replicas
        lines += ["  deploy:", "    replicas: 2"]
    return "".join(f"  {line}\n" for line in lines)


def compose_services(services: list[Deployed]) -> str:
    return "\n".join(compose_service(s) for s in services)


def compose_file(current: str, services: list[Deployed]) -> str:
    """docker-compose.yml with its generated blocks brought up to date."""
    text = replace_block(current, "NATS passwords", compose_nats_env(), "      ")
    return replace_block(text, "services", compose_services(services), "  ")
