"""A planted-secrets corpus: realistic Python, YAML, JSON, .env and shell files, each with secrets of one kind
written several ways, and the values planted (to check that none reaches the redacted text)."""

from __future__ import annotations

import json
import random
import string

ALNUM = string.ascii_letters + string.digits
B64 = ALNUM + "+/"


def _s(rng: random.Random, n: int, alphabet: str = ALNUM) -> str:
    return "".join(rng.choice(alphabet) for _ in range(n))


def _password(rng: random.Random) -> str:
    words = ["river", "Falcon", "tiger", "Maple", "orbit", "Copper", "delta", "Nimbus"]
    return rng.choice(
        [
            lambda: _s(rng, rng.randint(10, 20)),
            lambda: rng.choice(words) + str(rng.randint(10, 9999)) + rng.choice("!@#%^&*-_"),
            lambda: _s(rng, 6, string.ascii_lowercase) + str(rng.randint(100, 999)) + _s(rng, 3, string.ascii_uppercase),
            lambda: _s(rng, 12, ALNUM + "!#%&*+-=?"),
        ]
    )()


def _pem_body(rng: random.Random, lines: int) -> str:
    return "\n".join(_s(rng, 64, B64) for _ in range(lines)) + "\n" + _s(rng, 20, B64) + "=="


def _values(kind: str, rng: random.Random) -> str:
    if kind == "aws_access_key_id":
        return rng.choice(["AKIA", "ASIA"]) + _s(rng, 16, string.ascii_uppercase + string.digits)
    if kind == "aws_secret_access_key":
        return _s(rng, 40, B64)
    if kind == "github_token":
        return (
            rng.choice(["ghp_", "gho_", "ghs_", "ghu_"]) + _s(rng, 36)
            if rng.random() < 0.7
            else "github_pat_" + _s(rng, 22) + "_" + _s(rng, 59)
        )
    if kind == "gitlab_token":
        return "glpat-" + _s(rng, 20, ALNUM + "-_")
    if kind == "slack_token":
        return f"xox{rng.choice('bpa')}-{rng.randint(10**10, 10**11)}-{rng.randint(10**10, 10**11)}-{_s(rng, 24, string.ascii_lowercase + string.digits)}"
    if kind == "slack_webhook":
        return f"https://hooks.slack.com/services/T{_s(rng, 8, string.ascii_uppercase + string.digits)}/B{_s(rng, 8, string.ascii_uppercase + string.digits)}/{_s(rng, 24)}"
    if kind == "discord_webhook":
        return f"https://discord.com/api/webhooks/{rng.randint(10**17, 10**18)}/{_s(rng, 68, ALNUM + '-_')}"
    if kind == "stripe_key":
        return rng.choice(["sk_live_", "rk_live_", "sk_test_"]) + _s(rng, 24)
    if kind == "google_api_key":
        return "AIza" + _s(rng, 35, ALNUM + "-_")
    if kind == "openai_key":
        return rng.choice(["sk-", "sk-proj-"]) + _s(rng, 48)
    if kind == "jwt":
        return "eyJhbGciOiJIUzI1NiIsInR5cCI6IkpXVCJ9.eyJ" + _s(rng, 40, ALNUM + "-_") + "." + _s(rng, 43, ALNUM + "-_")
    if kind == "private_key_pem":
        label = rng.choice(["RSA ", "EC ", "DSA ", "", "ENCRYPTED "])
        return f"-----BEGIN {label}PRIVATE KEY-----\n{_pem_body(rng, rng.randint(3, 8))}\n-----END {label}PRIVATE KEY-----"
    if kind == "private_key_openssh":
        return f"-----BEGIN OPENSSH PRIVATE KEY-----\nb3BlbnNzaC1rZXktdjEAAAAA{_s(rng, 40, B64)}\n{_pem_body(rng, 5)}\n-----END OPENSSH PRIVATE KEY-----"
    if kind == "private_key_pgp":
        return (
            f"-----BEGIN PGP PRIVATE KEY BLOCK-----\nVersion: GnuPG v2\n\nlQOYBF{_s(rng, 58, B64)}\n{_pem_body(rng, 6)}\n="
            f"{_s(rng, 4, B64)}\n-----END PGP PRIVATE KEY BLOCK-----"
        )
    if kind == "private_key_putty":
        return (
            f"PuTTY-User-Key-File-{rng.choice('23')}: ssh-rsa\nEncryption: none\nComment: deploy-key\nPublic-Lines: 2\n"
            f"AAAAB3NzaC1yc2EAAAABJQAAAQEA{_s(rng, 36, B64)}\n{_s(rng, 64, B64)}\nPrivate-Lines: 4\n{_pem_body(rng, 3)}\n"
            f"Private-MAC: {_s(rng, 40, '0123456789abcdef')}"
        )
    if kind in ("prefixed_password", "api_token_assignment"):
        return _password(rng) if kind == "prefixed_password" else _s(rng, rng.randint(24, 40), ALNUM + rng.choice(["", "-_"]))
    if kind == "url_password":
        return _password(rng).replace("@", "!").replace("#", "!").replace("/", "!").replace("?", "!").replace("%", "!")
    if kind == "bearer_token":
        return _s(rng, rng.randint(32, 48), ALNUM + "-._")
    raise ValueError(kind)


PASSWORD_NAMES = [
    "DB_PASSWORD",
    "smtp_password",
    "ADMIN_PASS",
    "password",
    "POSTGRES_PASSWORD",
    "redisPassword",
    "mysql_root_pwd",
    "ldap_bind_passwd",
    "MAIL_PASS",
    "keystorePassword",
    "db.password",
    "app_secret",
    "CLIENT_SECRET",
    "django_secret_key",
    "SECRET_KEY",
    "jwtSecret",
    "session-secret",
]
TOKEN_NAMES = [
    "API_KEY",
    "apiKey",
    "api_token",
    "SENTRY_AUTH_TOKEN",
    "access_token",
    "serviceToken",
    "X_API_KEY",
    "datadog_api_key",
    "NPM_TOKEN",
    "refresh_token",
    "auth_token",
    "credentials",
    "private_key_value",
]
HOSTS = ["rabbitmq:5672", "db", "redis:6379", "localhost:5432", "10.0.3.7:3306", "mongo-0.mongo:27017", "db.internal.example.com"]
SCHEMES = ["amqp", "postgresql", "mysql", "redis", "mongodb", "https", "ftp", "postgres+psycopg2"]


def _embed(kind: str, value: str, rng: random.Random) -> tuple[str, str]:
    """A file (name, text) holding `value` the way `kind` is usually written; the style is drawn at random."""
    if kind.startswith("private_key"):
        style = rng.choice(["file", "python", "yaml", "json"])
        if style == "file":
            return rng.choice(["id_rsa", "deploy.key", "server.pem", "key.ppk", "secring.asc"]), value + "\n"
        if style == "python":
            return "keys.py", f'import ssl\n\nSIGNING_KEY = """{value}\n"""\n\n\ndef load():\n    return SIGNING_KEY.encode()\n'
        if style == "yaml":
            body = "\n".join("    " + line for line in value.splitlines())
            return "secrets.yaml", f"apiVersion: v1\nkind: Secret\nstringData:\n  tls.key: |\n{body}\n  tls.crt: see-cert-manager\n"
        return "service-account.json", json.dumps(
            {
                "type": "service_account",
                "project_id": "demo-123",
                "private_key": value + "\n",
                "client_email": "svc@demo-123.iam.gserviceaccount.com",
            },
            indent=2,
        ) + "\n"
    if kind == "prefixed_password" or kind == "api_token_assignment":
        name = rng.choice(PASSWORD_NAMES if kind == "prefixed_password" else TOKEN_NAMES)
        style = rng.choice(["python", "env", "yaml", "json", "shell", "kwarg", "ini", "annotated"])
        return {
            "python": (
                "settings.py",
                f'import os\n\nDEBUG = False\n{name.replace(".", "_").replace("-", "_")} = "{value}"\nTIMEOUT = 30\n',
            ),
            "env": (".env", f"APP_ENV=production\n{name.upper().replace('.', '_').replace('-', '_')}={value}\nLOG_LEVEL=info\n"),
            "yaml": ("config.yaml", f"service:\n  host: 0.0.0.0\n  port: 8080\n  {name}: {value}\n  workers: 4\n"),
            "json": ("config.json", json.dumps({"name": "billing", "retries": 3, name: value}, indent=2) + "\n"),
            "shell": (
                "deploy.sh",
                f"#!/usr/bin/env bash\nset -euo pipefail\nexport {name.upper().replace('.', '_').replace('-', '_')}='{value}'\n./run.sh --prod\n",
            ),
            "kwarg": (
                "db.py",
                f"import psycopg2\n\nconn = psycopg2.connect(host='db', user='app', {name.replace('.', '_').replace('-', '_')}='{value}')\n",
            ),
            "ini": ("app.ini", f"[database]\nhost = db\nuser = app\n{name} = {value}\n"),
            "annotated": (
                "conf.py",
                f'class Settings:\n    {name.replace(".", "_").replace("-", "_")}: str = "{value}"\n    retries: int = 3\n',
            ),
        }[style]
    if kind == "url_password":
        user, host, scheme = rng.choice(["user", "admin", "app", "guest", "svc_reader"]), rng.choice(HOSTS), rng.choice(SCHEMES)
        url = f"{scheme}://{user}:{value}@{host}/{rng.choice(['app', 'vhost', '0', 'prod'])}"
        return rng.choice(
            [
                ("settings.py", f'BROKER_URL = "{url}"\n'),
                (".env", f"DATABASE_URL={url}\n"),
                ("docker-compose.yml", f"services:\n  worker:\n    environment:\n      - CELERY_BROKER={url}\n"),
                ("run.sh", f"psql '{url}' -c 'select 1'\n"),
            ]
        )
    if kind == "aws_secret_access_key":
        name = rng.choice(["AWS_SECRET_ACCESS_KEY", "aws_secret_access_key", "awsSecretKey", "AWS_SECRET_KEY", "secretAccessKey"])
        return rng.choice(
            [
                ("settings.py", f'AWS_ACCESS_KEY_ID = "AKIA{_s(rng, 16, string.ascii_uppercase + string.digits)}"\n{name} = "{value}"\n'),
                ("credentials", f"[default]\naws_access_key_id = AKIA{_s(rng, 16, string.ascii_uppercase)}\n{name} = {value}\n"),
                (".env", f"{name.upper()}={value}\n"),
                ("s3.py", f'import boto3\n\ns3 = boto3.client("s3", aws_secret_access_key="{value}")\n'),
                ("config.json", json.dumps({"region": "us-east-1", name: value}) + "\n"),
            ]
        )
    if kind == "bearer_token":
        return rng.choice(
            [
                ("client.py", f'headers = {{"Authorization": "Bearer {value}"}}\n'),
                ("call.sh", f"curl -H 'Authorization: Bearer {value}' https://api.internal/v1/items\n"),
            ]
        )
    # token-shaped values: anywhere, with or without a telling name
    name = rng.choice(["TOKEN", "key", "WEBHOOK_URL", "url", "value", "CREDENTIAL", "notify"])
    return rng.choice(
        [
            ("settings.py", f'{name} = "{value}"\n'),
            (".env", f"{name.upper()}={value}\n"),
            ("config.yaml", f"alerts:\n  {name.lower()}: {value}\n"),
            ("notify.sh", f'curl -X POST "{value}" -d @payload.json\n'),
            ("app.json", json.dumps({name: value}) + "\n"),
            ("client.py", f'client = Client("{value}")\n'),
        ]
    )


KINDS = [
    "aws_access_key_id",
    "aws_secret_access_key",
    "github_token",
    "gitlab_token",
    "slack_token",
    "slack_webhook",
    "discord_webhook",
    "stripe_key",
    "google_api_key",
    "openai_key",
    "jwt",
    "private_key_pem",
    "private_key_openssh",
    "private_key_pgp",
    "private_key_putty",
    "prefixed_password",
    "api_token_assignment",
    "url_password",
    "bearer_token",
]


def planted_corpus(per_kind: int = 40, seed: int = 0) -> list[tuple[str, str, str, str]]:
    """(kind, file name, text, value) for `per_kind` files of each kind."""
    rng = random.Random(seed)
    out = []
    for kind in KINDS:
        for _ in range(per_kind):
            value = _values(kind, rng)
            name, text = _embed(kind, value, rng)
            out.append((kind, name, text, value))
    return out


def value_survives(value: str, text: str) -> bool:
    """Whether any part of a planted value that could identify it (a line of a key block of 16 characters or more,
    or the whole value) is still in `text`."""
    pieces = [
        line.strip()
        for line in value.splitlines()
        if len(line.strip()) >= 16
        and "PRIVATE KEY" not in line
        and not line.startswith(("PuTTY", "Public-Lines", "Encryption", "Comment", "AAAAB3", "Version"))
    ]
    return value in text or any(piece in text for piece in pieces) or any(piece in text.replace("\n", "\\n") for piece in pieces)
