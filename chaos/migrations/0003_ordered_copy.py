from django.db import migrations, models


class Migration(migrations.Migration):
    dependencies = [
        ("chaos", "0002_triggers"),
    ]

    operations = [
        migrations.CreateModel(
            name="OrderedCopy",
            fields=[
                ("position", models.PositiveIntegerField(primary_key=True, serialize=False)),
                ("event_id", models.UUIDField()),
                ("destination", models.CharField(max_length=255)),
                ("ordering_key", models.CharField(max_length=255)),
                ("sequence", models.BigIntegerField()),
            ],
        ),
    ]
