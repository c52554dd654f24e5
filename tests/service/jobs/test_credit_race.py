"""Two creates can never spend the same credit: concurrent requests against the live server.

CI runs this on SQLite and on PostgreSQL (where the project row lock is what serializes them).
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from decimal import Decimal
from typing import Any

from django.db import connection

from registry.models import CreditTransaction, Project

from ..helpers import People


def test_concurrent_creates_never_overspend_the_balance(people: People, adapter: dict[str, Any]) -> None:
    project = Project.objects.get(pk=people.project_a.pk)
    project.add_credit(Decimal("-9.70"), "leave $0.30: three $0.10 jobs")
    attempts = 12

    def create(_: int) -> int:
        return people.alice.create(adapter_object_id=adapter["id"]).status_code

    with ThreadPoolExecutor(max_workers=attempts) as pool:
        codes = list(pool.map(create, range(attempts)))
    assert sorted(codes) == [201] * 3 + [402] * (attempts - 3), (connection.vendor, codes)
    credit = project.credit()
    assert (credit.balance, credit.held, credit.available) == (Decimal("0.30"), Decimal("0.30"), Decimal("0.00"))
    assert CreditTransaction.objects.filter(project=project, kind="hold").count() == 3
    assert project.jobs.count() == 3
