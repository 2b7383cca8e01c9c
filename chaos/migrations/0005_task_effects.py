from django.db import migrations, models


class Migration(migrations.Migration):
    dependencies = [
        ("chaos", "0004_followers_are_not_finalized"),
    ]

    operations = [
        migrations.CreateModel(
            name="TaskEffect",
            fields=[
                (
                    "id",
                    models.BigAutoField(
                        auto_created=True, primary_key=True, serialize=False, verbose_name="ID"
                    ),
                ),
                ("result_id", models.UUIDField(db_index=True)),
                ("order", models.UUIDField()),
                ("attempt", models.PositiveSmallIntegerField()),
                ("pid", models.IntegerField()),
                ("ran_at", models.DateTimeField(auto_now_add=True)),
            ],
        ),
    ]
