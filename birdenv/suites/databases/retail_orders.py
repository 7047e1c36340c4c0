"""retail_orders: a large online-retail database (customers, orders, order items, catalogue).

The large database of the bundled suites (well over 100 MB once built): about 150k customers,
350k orders and 1M order items, plus a small catalogue (categories, suppliers, products),
product reviews and returns. Timestamps are TEXT, some ship dates are NULL, prices are REAL,
``orders.shipping_address`` and ``products.attributes`` hold JSON text. Orders and their items
cascade on delete. Tasks on it must use indexed lookups or the small tables.
"""

from __future__ import annotations

import json
import random
import sqlite3
from array import array
from datetime import date, datetime, timedelta

from birdenv.suites.databases._names import SURNAMES

DB_ID = "retail_orders"
VERSION = 1

SEED = 20240611
N_CUSTOMERS = 150_000
N_ORDERS = 350_000
N_PRODUCTS = 2_400
N_SUPPLIERS = 60
N_REVIEWS = 60_000
N_RETURNS = 18_000

SCHEMA = [
    """CREATE TABLE categories (
    category_id INTEGER PRIMARY KEY,
    name TEXT NOT NULL,
    parent_id INTEGER REFERENCES categories (category_id)
)""",
    """CREATE TABLE suppliers (
    supplier_id INTEGER PRIMARY KEY,
    "Company Name" TEXT NOT NULL,
    country TEXT NOT NULL,
    contact_email TEXT,
    "Lead Time Days" INTEGER,
    rating REAL
)""",
    """CREATE TABLE products (
    product_id INTEGER PRIMARY KEY,
    sku TEXT NOT NULL UNIQUE,
    name TEXT NOT NULL,
    category_id INTEGER NOT NULL REFERENCES categories (category_id),
    supplier_id INTEGER REFERENCES suppliers (supplier_id) ON DELETE SET NULL,
    list_price REAL NOT NULL,
    unit_cost REAL,
    stock_qty INTEGER NOT NULL DEFAULT 0,
    discontinued INTEGER NOT NULL DEFAULT 0,
    launched_on TEXT,
    attributes TEXT
)""",
    """CREATE TABLE customers (
    customer_id INTEGER PRIMARY KEY,
    first_name TEXT NOT NULL,
    last_name TEXT NOT NULL,
    email TEXT NOT NULL,
    phone TEXT,
    city TEXT,
    state TEXT,
    country TEXT NOT NULL DEFAULT 'US',
    signup_date TEXT NOT NULL,
    birth_date TEXT,
    "Loyalty Tier" TEXT,
    marketing_opt_in INTEGER NOT NULL DEFAULT 0
)""",
    """CREATE TABLE orders (
    order_id INTEGER PRIMARY KEY,
    customer_id INTEGER NOT NULL REFERENCES customers (customer_id) ON DELETE CASCADE,
    order_ts TEXT NOT NULL,
    status TEXT NOT NULL,
    ship_date TEXT,
    delivered_date TEXT,
    payment_method TEXT,
    coupon_code TEXT,
    shipping_fee REAL NOT NULL DEFAULT 0,
    total_amount REAL NOT NULL,
    shipping_address TEXT
)""",
    """CREATE TABLE order_items (
    order_item_id INTEGER PRIMARY KEY,
    order_id INTEGER NOT NULL REFERENCES orders (order_id) ON DELETE CASCADE,
    line_no INTEGER NOT NULL,
    product_id INTEGER NOT NULL REFERENCES products (product_id),
    quantity INTEGER NOT NULL,
    unit_price REAL NOT NULL,
    discount REAL NOT NULL DEFAULT 0
)""",
    """CREATE TABLE product_reviews (
    review_id INTEGER PRIMARY KEY,
    product_id INTEGER NOT NULL REFERENCES products (product_id) ON DELETE CASCADE,
    customer_id INTEGER NOT NULL REFERENCES customers (customer_id) ON DELETE CASCADE,
    rating INTEGER NOT NULL,
    review_date TEXT NOT NULL,
    title TEXT,
    verified_purchase INTEGER NOT NULL DEFAULT 0
)""",
    """CREATE TABLE "Returns" (
    return_id INTEGER PRIMARY KEY,
    order_item_id INTEGER NOT NULL REFERENCES order_items (order_item_id) ON DELETE CASCADE,
    return_date TEXT NOT NULL,
    reason TEXT,
    refund_amount REAL
)""",
    """CREATE TABLE stock_movements (
    movement_id INTEGER PRIMARY KEY,
    product_id INTEGER NOT NULL REFERENCES products (product_id) ON DELETE CASCADE,
    change_qty INTEGER NOT NULL,
    reason TEXT NOT NULL,
    moved_at TEXT NOT NULL
)""",
]

# Created after the bulk load (faster, and the trigger must not fire during it).
INDEXES = [
    "CREATE INDEX idx_categories_parent ON categories (parent_id)",
    "CREATE INDEX idx_products_category ON products (category_id)",
    "CREATE INDEX idx_products_supplier ON products (supplier_id)",
    "CREATE INDEX idx_customers_email ON customers (email)",
    "CREATE INDEX idx_customers_last_name ON customers (last_name)",
    "CREATE INDEX idx_customers_state ON customers (state)",
    "CREATE INDEX idx_orders_customer ON orders (customer_id)",
    "CREATE INDEX idx_orders_ts ON orders (order_ts)",
    "CREATE INDEX idx_order_items_order ON order_items (order_id)",
    "CREATE INDEX idx_order_items_product ON order_items (product_id)",
    "CREATE INDEX idx_reviews_product ON product_reviews (product_id)",
    "CREATE INDEX idx_reviews_customer ON product_reviews (customer_id)",
    'CREATE INDEX idx_returns_item ON "Returns" (order_item_id)',
    "CREATE INDEX idx_stock_movements_product ON stock_movements (product_id)",
]

VIEWS_AND_TRIGGERS = [
    """CREATE VIEW v_customer_orders AS
SELECT o.order_id, o.order_ts, o.status, o.total_amount,
       c.customer_id, c.first_name || ' ' || c.last_name AS customer_name, c.email, c.state
FROM orders AS o
JOIN customers AS c ON c.customer_id = o.customer_id""",
    """CREATE VIEW v_product_catalog AS
SELECT p.product_id, p.sku, p.name, cat.name AS category, s."Company Name" AS supplier,
       p.list_price, p.stock_qty, p.discontinued
FROM products AS p
JOIN categories AS cat ON cat.category_id = p.category_id
LEFT JOIN suppliers AS s ON s.supplier_id = p.supplier_id""",
    """CREATE TRIGGER trg_order_items_stock AFTER INSERT ON order_items
BEGIN
    UPDATE products SET stock_qty = stock_qty - NEW.quantity WHERE product_id = NEW.product_id;
    INSERT INTO stock_movements (product_id, change_qty, reason, moved_at)
    VALUES (NEW.product_id, -NEW.quantity, 'sale', datetime('now'));
END""",
]

FIRST = [
    "James",
    "Mary",
    "Robert",
    "Patricia",
    "John",
    "Jennifer",
    "Michael",
    "Linda",
    "David",
    "Elizabeth",
    "William",
    "Barbara",
    "Richard",
    "Susan",
    "Joseph",
    "Jessica",
    "Thomas",
    "Sarah",
    "Carlos",
    "Karen",
    "Daniel",
    "Lisa",
    "Matthew",
    "Nancy",
    "Anthony",
    "Betty",
    "Mark",
    "Sandra",
    "Donald",
    "Ashley",
    "Steven",
    "Kimberly",
    "Andrew",
    "Emily",
    "Paul",
    "Donna",
    "Joshua",
    "Michelle",
    "Kenneth",
    "Carol",
    "Kevin",
    "Amanda",
    "Brian",
    "Melissa",
    "Wei",
    "Priya",
    "Mohammed",
    "Sofia",
    "Hiroshi",
    "Ana",
    "Luis",
    "Fatima",
    "Olga",
    "Raj",
]
LAST = [
    *SURNAMES,
    "Torres",
    "Nguyen",
    "Hill",
    "Flores",
    "Green",
    "Adams",
    "Nelson",
    "Baker",
    "Hall",
    "Rivera",
    "Campbell",
    "Mitchell",
    "Carter",
    "Roberts",
    "O'Brien",
    "Patel",
    "Kim",
    "Chen",
]
CITIES = [
    ("Austin", "TX"),
    ("Dallas", "TX"),
    ("Houston", "TX"),
    ("San Antonio", "TX"),
    ("Los Angeles", "CA"),
    ("San Diego", "CA"),
    ("San Jose", "CA"),
    ("Sacramento", "CA"),
    ("Fresno", "CA"),
    ("New York", "NY"),
    ("Buffalo", "NY"),
    ("Rochester", "NY"),
    ("Chicago", "IL"),
    ("Springfield", "IL"),
    ("Phoenix", "AZ"),
    ("Tucson", "AZ"),
    ("Philadelphia", "PA"),
    ("Pittsburgh", "PA"),
    ("Jacksonville", "FL"),
    ("Miami", "FL"),
    ("Tampa", "FL"),
    ("Orlando", "FL"),
    ("Columbus", "OH"),
    ("Cleveland", "OH"),
    ("Seattle", "WA"),
    ("Spokane", "WA"),
    ("Denver", "CO"),
    ("Boston", "MA"),
    ("Portland", "OR"),
    ("Atlanta", "GA"),
    ("Nashville", "TN"),
    ("Detroit", "MI"),
    ("Minneapolis", "MN"),
    ("Charlotte", "NC"),
    ("Raleigh", "NC"),
    ("Las Vegas", "NV"),
    ("Springfield", "MO"),
    ("Kansas City", "MO"),
    ("Salt Lake City", "UT"),
    ("Omaha", "NE"),
]
STREETS = [
    "Main St",
    "Oak Ave",
    "Maple Dr",
    "Cedar Ln",
    "Pine St",
    "Elm St",
    "Lakeview Rd",
    "Washington Blvd",
    "Park Ave",
    "Sunset Blvd",
    "Hillcrest Dr",
    "River Rd",
    "2nd St",
]
CATEGORY_TREE = [
    ("Electronics", ["Laptops", "Phones", "Headphones", "Cameras", "Smart Home"]),
    ("Home & Kitchen", ["Cookware", "Furniture", "Bedding", "Lighting"]),
    ("Clothing", ["Men's Apparel", "Women's Apparel", "Shoes", "Accessories"]),
    ("Sports & Outdoors", ["Camping", "Fitness", "Cycling"]),
    ("Books", ["Fiction", "Non-Fiction", "Children's Books"]),
    ("Toys & Games", ["Board Games", "Puzzles", "Outdoor Toys"]),
    ("Beauty", ["Skincare", "Haircare"]),
    ("Grocery", ["Coffee & Tea", "Snacks"]),
]
ADJ = [
    "Classic",
    "Ultra",
    "Eco",
    "Pro",
    "Compact",
    "Deluxe",
    "Smart",
    "Vintage",
    "Premium",
    "Essential",
    "Lite",
    "Max",
    "Urban",
    "Nordic",
    "Rapid",
]
NOUN = {
    "Laptops": "Laptop",
    "Phones": "Phone",
    "Headphones": "Headphones",
    "Cameras": "Camera",
    "Smart Home": "Smart Plug",
    "Cookware": "Skillet",
    "Furniture": "Side Table",
    "Bedding": "Duvet Cover",
    "Lighting": "Desk Lamp",
    "Men's Apparel": "Oxford Shirt",
    "Women's Apparel": "Linen Dress",
    "Shoes": "Running Shoe",
    "Accessories": "Leather Belt",
    "Camping": "Tent",
    "Fitness": "Yoga Mat",
    "Cycling": "Bike Helmet",
    "Fiction": "Novel",
    "Non-Fiction": "Field Guide",
    "Children's Books": "Picture Book",
    "Board Games": "Board Game",
    "Puzzles": "Jigsaw Puzzle",
    "Outdoor Toys": "Kite",
    "Skincare": "Face Cream",
    "Haircare": "Shampoo",
    "Coffee & Tea": "Coffee Beans",
    "Snacks": "Trail Mix",
}
PRICE_RANGE = {
    "Laptops": (499, 2499),
    "Phones": (199, 1299),
    "Headphones": (19, 399),
    "Cameras": (149, 1899),
    "Smart Home": (15, 249),
    "Cookware": (19, 299),
    "Furniture": (49, 899),
    "Bedding": (25, 249),
    "Lighting": (15, 199),
    "Men's Apparel": (15, 129),
    "Women's Apparel": (15, 179),
    "Shoes": (39, 219),
    "Accessories": (9, 149),
    "Camping": (19, 599),
    "Fitness": (9, 349),
    "Cycling": (19, 499),
    "Fiction": (7, 29),
    "Non-Fiction": (9, 45),
    "Children's Books": (5, 25),
    "Board Games": (15, 89),
    "Puzzles": (9, 49),
    "Outdoor Toys": (9, 99),
    "Skincare": (8, 89),
    "Haircare": (5, 49),
    "Coffee & Tea": (6, 39),
    "Snacks": (3, 19),
}
COLORS = ["black", "white", "silver", "red", "blue", "green", "navy", "grey", "beige"]
COUNTRIES = ["US", "US", "US", "CN", "DE", "MX", "VN", "IN", "IT", "CA"]
STATUSES = (
    ["delivered"] * 80 + ["shipped"] * 6 + ["cancelled"] * 7 + ["returned"] * 4 + ["processing"] * 3
)
PAYMENTS = ["credit_card"] * 6 + ["paypal"] * 2 + ["debit_card"] * 2 + ["gift_card", "apple_pay"]
COUPONS = ["WELCOME10", "SPRING15", "BLACKFRIDAY", "FREESHIP", "VIP20"]
RETURN_REASONS = [
    "damaged",
    "wrong size",
    "not as described",
    "changed mind",
    "late delivery",
    None,
]
REVIEW_TITLES = [
    "Great value",
    "Does the job",
    "Disappointed",
    "Love it!",
    "Would buy again",
    "Not worth the price",
    "Exactly as pictured",
    "Stopped working",
    None,
    None,
]

EPOCH = datetime(2021, 1, 1)
SPAN_SECONDS = int((datetime(2025, 1, 1) - EPOCH).total_seconds())
END_DATE = date(2024, 12, 31)


def _categories():
    cid = 0
    leaves = []
    rows = []
    for top, children in CATEGORY_TREE:
        cid += 1
        top_id = cid
        rows.append((top_id, top, None))
        for child in children:
            cid += 1
            rows.append((cid, child, top_id))
            leaves.append((cid, child))
    return rows, leaves


def _suppliers(rng):
    words = [
        "Acme",
        "Globex",
        "Initech",
        "Umbrella",
        "Northwind",
        "Contoso",
        "Fabrikam",
        "Tailspin",
        "Wide World",
        "Adventure Works",
        "Blue Yonder",
        "Litware",
        "Proseware",
        "Lucerne",
        "Coho",
        "Woodgrove",
        "Alpine",
        "Summit",
        "Harbor",
        "Pioneer",
    ]
    kinds = ["Trading", "Imports", "Manufacturing", "Supply Co.", "Goods", "Industries"]
    for sid in range(1, N_SUPPLIERS + 1):
        name = f"{words[(sid - 1) % len(words)]} {kinds[(sid - 1) // len(words) % len(kinds)]}"
        if sid % 17 == 0:
            name += " "  # a trailing space, as imported from a spreadsheet
        email = None if rng.random() < 0.15 else f"sales{sid}@{name.split()[0].lower()}.example.com"
        lead = None if rng.random() < 0.1 else rng.randint(2, 45)
        rating = None if rng.random() < 0.2 else round(rng.uniform(2.5, 5.0), 1)
        yield sid, name, rng.choice(COUNTRIES), email, lead, rating


def _products(rng, leaves, prices):
    for pid in range(1, N_PRODUCTS + 1):
        cat_id, cat = leaves[rng.randrange(len(leaves))]
        lo, hi = PRICE_RANGE[cat]
        price = round(rng.uniform(lo, hi)) - 0.01 if hi > 30 else round(rng.uniform(lo, hi), 2)
        price = max(price, 1.99)
        prices.append(price)
        cost = None if rng.random() < 0.05 else round(price * rng.uniform(0.35, 0.75), 2)
        attrs = {"color": rng.choice(COLORS)}
        if cat in ("Shoes", "Men's Apparel", "Women's Apparel"):
            attrs["size"] = (
                rng.choice(["XS", "S", "M", "L", "XL"])
                if cat != "Shoes"
                else str(rng.randint(5, 13))
            )
        if cat in ("Laptops", "Phones", "Headphones", "Cameras", "Smart Home"):
            attrs["warranty_months"] = rng.choice([6, 12, 12, 24, 36])
            attrs["wireless"] = rng.random() < 0.6
        attrs["weight_kg"] = round(rng.uniform(0.1, 12.0), 2)
        if rng.random() < 0.3:
            attrs["tags"] = rng.sample(
                ["bestseller", "gift", "eco", "new", "clearance", "bundle"], 2
            )
        supplier = None if rng.random() < 0.03 else rng.randint(1, N_SUPPLIERS)
        launched = date(2018, 1, 1) + timedelta(days=rng.randrange(2200))
        yield (
            pid,
            f"SKU-{cat_id:02d}-{pid:05d}",
            f"{rng.choice(ADJ)} {NOUN[cat]} {rng.randint(100, 999)}",
            cat_id,
            supplier,
            price,
            cost,
            rng.randint(0, 500),
            1 if rng.random() < 0.06 else 0,
            launched.isoformat() if rng.random() > 0.04 else None,
            json.dumps(attrs) if rng.random() > 0.02 else None,
        )


def _customers(rng, homes):
    tiers = ["Gold", "Silver", "Silver", "Bronze", "Bronze", "Bronze", None, None, None, None]
    for cid in range(1, N_CUSTOMERS + 1):
        first = rng.choice(FIRST)
        last = rng.choice(LAST)
        city, state = CITIES[rng.randrange(len(CITIES))]
        homes.append(CITIES.index((city, state)))
        domain = rng.choice(["gmail.com", "yahoo.com", "outlook.com", "example.org", "icloud.com"])
        email = f"{first.lower()}.{last.lower().replace(chr(39), '')}{cid}@{domain}"
        if cid % 97 == 0:
            email = email.upper()  # legacy imports kept upper case
        phone = (
            None
            if rng.random() < 0.22
            else f"({rng.randint(201, 989)}) {rng.randint(200, 999)}-{rng.randint(0, 9999):04d}"
        )
        signup = date(2019, 1, 1) + timedelta(days=rng.randrange(2190))
        birth = (
            None
            if rng.random() < 0.3
            else (date(1950, 1, 1) + timedelta(days=rng.randrange(19000))).isoformat()
        )
        yield (
            cid,
            first,
            last,
            email,
            phone,
            city,
            state,
            "US",
            signup.isoformat(),
            birth,
            tiers[rng.randrange(10)],
            1 if rng.random() < 0.45 else 0,
        )


def _order_items(rng, prices, totals, first_item):
    """Items of every order; fills ``totals`` (items sum per order) and ``first_item`` ids."""
    item_id = 0
    n_products = len(prices)
    hot = [rng.randrange(1, n_products + 1) for _ in range(150)]
    qty_choices = [1] * 14 + [2] * 4 + [3, 4]
    disc_choices = [0.0] * 16 + [0.05, 0.1, 0.15, 0.25]
    lines_choices = [1, 1, 2, 2, 2, 3, 3, 3, 4, 4, 5, 6]
    randrange = rng.randrange
    for oid in range(1, N_ORDERS + 1):
        first_item.append(item_id + 1)
        total = 0.0
        for line in range(1, lines_choices[randrange(12)] + 1):
            item_id += 1
            pid = hot[randrange(150)] if randrange(4) == 0 else randrange(1, n_products + 1)
            qty = qty_choices[randrange(20)]
            disc = disc_choices[randrange(20)]
            price = prices[pid - 1]
            total += qty * price * (1 - disc)
            yield item_id, oid, line, pid, qty, price, disc
        totals.append(total)
    first_item.append(item_id + 1)


def _orders(rng, totals, homes):
    stamps = sorted(rng.randrange(SPAN_SECONDS) for _ in range(N_ORDERS))
    for i, secs in enumerate(stamps):
        oid = i + 1
        ts = EPOCH + timedelta(seconds=secs)
        cust = rng.randint(1, N_CUSTOMERS)
        status = STATUSES[rng.randrange(100)]
        if ts.date() > END_DATE - timedelta(days=5):
            status = rng.choice(["processing", "processing", "shipped", "cancelled"])
        ship = delivered = None
        if status in ("shipped", "delivered", "returned"):
            ship_d = ts.date() + timedelta(days=rng.choice([0, 1, 1, 2, 2, 3, 4, 7]))
            if rng.random() < 0.015:
                ship_d = None  # warehouse never scanned the parcel
            ship = ship_d.isoformat() if ship_d else None
            if status != "shipped":
                delivered = (ts.date() + timedelta(days=rng.randint(2, 12))).isoformat()
        city, state = (
            CITIES[homes[cust - 1]] if rng.random() < 0.9 else CITIES[rng.randrange(len(CITIES))]
        )
        addr = {
            "street": f"{rng.randint(1, 9999)} {rng.choice(STREETS)}",
            "city": city,
            "state": state,
            "zip": f"{rng.randint(10000, 99999)}",
            "country": "US",
        }
        if rng.random() < 0.05:
            addr["gift"] = True
        fee = 0.0 if totals[i] >= 50 else rng.choice([4.99, 5.99, 7.99])
        coupon = COUPONS[rng.randrange(5)] if rng.random() < 0.12 else None
        yield (
            oid,
            cust,
            ts.strftime("%Y-%m-%d %H:%M:%S"),
            status,
            ship,
            delivered,
            PAYMENTS[rng.randrange(12)],
            coupon,
            fee,
            round(totals[i] + fee, 2),
            json.dumps(addr) if rng.random() > 0.01 else None,
        )


def _reviews(rng):
    for rid in range(1, N_REVIEWS + 1):
        rating = rng.choice([1, 2, 3, 4, 4, 5, 5, 5])
        day = date(2021, 1, 15) + timedelta(days=rng.randrange(1440))
        yield (
            rid,
            rng.randint(1, N_PRODUCTS),
            rng.randint(1, N_CUSTOMERS),
            rating,
            day.isoformat(),
            rng.choice(REVIEW_TITLES),
            1 if rng.random() < 0.7 else 0,
        )


def _returns(rng, n_items):
    picked = sorted(rng.sample(range(1, n_items + 1), N_RETURNS))
    for rid, item in enumerate(picked, 1):
        day = date(2021, 1, 10) + timedelta(days=rng.randrange(1450))
        refund = None if rng.random() < 0.08 else round(rng.uniform(5, 400), 2)
        yield rid, item, day.isoformat(), rng.choice(RETURN_REASONS), refund


def _stock_movements(rng):
    mid = 0
    for pid in range(1, N_PRODUCTS + 1):
        for _ in range(rng.randint(1, 4)):
            mid += 1
            moved = EPOCH + timedelta(seconds=rng.randrange(SPAN_SECONDS))
            yield mid, pid, rng.randint(10, 300), "restock", moved.strftime("%Y-%m-%d %H:%M:%S")


def build(conn: sqlite3.Connection) -> None:
    """Fill an empty database inside the caller's open transaction."""
    rng = random.Random(SEED)
    for stmt in SCHEMA:
        conn.execute(stmt)
    cats, leaves = _categories()
    conn.executemany("INSERT INTO categories VALUES (?, ?, ?)", cats)
    conn.executemany("INSERT INTO suppliers VALUES (?, ?, ?, ?, ?, ?)", _suppliers(rng))
    prices: list[float] = []
    conn.executemany(
        "INSERT INTO products VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?)",
        _products(rng, leaves, prices),
    )
    homes = array("i")
    conn.executemany(
        "INSERT INTO customers VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?)", _customers(rng, homes)
    )
    totals = array("d")
    first_item = array("i")
    conn.executemany(
        "INSERT INTO order_items VALUES (?, ?, ?, ?, ?, ?, ?)",
        _order_items(random.Random(SEED + 1), prices, totals, first_item),
    )
    conn.executemany(
        "INSERT INTO orders VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?)",
        _orders(random.Random(SEED + 2), totals, homes),
    )
    conn.executemany("INSERT INTO product_reviews VALUES (?, ?, ?, ?, ?, ?, ?)", _reviews(rng))
    conn.executemany(
        'INSERT INTO "Returns" VALUES (?, ?, ?, ?, ?)', _returns(rng, first_item[-1] - 1)
    )
    conn.executemany("INSERT INTO stock_movements VALUES (?, ?, ?, ?, ?)", _stock_movements(rng))
    for stmt in INDEXES + VIEWS_AND_TRIGGERS:
        conn.execute(stmt)
    conn.execute("ANALYZE")
