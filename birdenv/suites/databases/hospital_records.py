"""``hospital_records``: a mid-size hospital's patients, admissions, labs, diagnoses and staff.

Timestamps are TEXT (``'2021-03-04 13:05:00'``), some admissions are still open (NULL
``discharge_time``), lab values are REAL with units and NULLs (cancelled or hemolysed samples), a
few creatinine results are reported in umol/L instead of mg/dL, some city names carry a trailing
space, allergies are JSON text. Awkward names: the table ``"Ward Transfers"`` and the column
``patients."Emergency Contact"``. One view (``v_admission_summary``) and one trigger
(``trg_admissions_discharge_audit``) writing to ``audit_log``.
"""

from __future__ import annotations

import json
import random
import sqlite3
from datetime import datetime, timedelta

from birdenv.suites.databases._names import SURNAMES

DB_ID = "hospital_records"
VERSION = 1

SEED = 20240611
N_PATIENTS = 8000
N_ADMISSIONS = 12000

SCHEMA = [
    """CREATE TABLE departments (
        dept_id INTEGER PRIMARY KEY,
        name TEXT NOT NULL UNIQUE,
        floor INTEGER,
        building TEXT,
        bed_count INTEGER
    )""",
    """CREATE TABLE physicians (
        physician_id INTEGER PRIMARY KEY,
        first_name TEXT NOT NULL,
        last_name TEXT NOT NULL,
        specialty TEXT NOT NULL,
        dept_id INTEGER REFERENCES departments(dept_id),
        hire_date TEXT NOT NULL,
        email TEXT,
        status TEXT NOT NULL DEFAULT 'active'
    )""",
    """CREATE TABLE patients (
        patient_id INTEGER PRIMARY KEY,
        mrn TEXT NOT NULL UNIQUE,
        first_name TEXT NOT NULL,
        last_name TEXT NOT NULL,
        sex TEXT,
        birth_date TEXT NOT NULL,
        blood_type TEXT,
        city TEXT,
        insurance_provider TEXT,
        "Emergency Contact" TEXT,
        allergies TEXT,
        registered_at TEXT NOT NULL
    )""",
    """CREATE TABLE admissions (
        admission_id INTEGER PRIMARY KEY,
        patient_id INTEGER NOT NULL REFERENCES patients(patient_id),
        physician_id INTEGER REFERENCES physicians(physician_id),
        dept_id INTEGER NOT NULL REFERENCES departments(dept_id),
        admission_type TEXT NOT NULL,
        admit_time TEXT NOT NULL,
        discharge_time TEXT,
        discharge_disposition TEXT,
        room TEXT,
        total_charge REAL
    )""",
    """CREATE TABLE diagnoses (
        diagnosis_id INTEGER PRIMARY KEY,
        admission_id INTEGER NOT NULL REFERENCES admissions(admission_id) ON DELETE CASCADE,
        icd_code TEXT NOT NULL,
        description TEXT NOT NULL,
        is_primary INTEGER NOT NULL DEFAULT 0,
        diagnosed_at TEXT NOT NULL
    )""",
    """CREATE TABLE lab_results (
        lab_id INTEGER PRIMARY KEY,
        admission_id INTEGER NOT NULL REFERENCES admissions(admission_id) ON DELETE CASCADE,
        test_name TEXT NOT NULL,
        value REAL,
        unit TEXT NOT NULL,
        ref_low REAL,
        ref_high REAL,
        flag TEXT,
        result_status TEXT NOT NULL DEFAULT 'final',
        collected_at TEXT NOT NULL
    )""",
    """CREATE TABLE prescriptions (
        prescription_id INTEGER PRIMARY KEY,
        admission_id INTEGER NOT NULL REFERENCES admissions(admission_id) ON DELETE CASCADE,
        drug_name TEXT NOT NULL,
        dose_mg REAL,
        frequency TEXT,
        route TEXT,
        start_date TEXT NOT NULL,
        end_date TEXT
    )""",
    """CREATE TABLE "Ward Transfers" (
        transfer_id INTEGER PRIMARY KEY,
        admission_id INTEGER NOT NULL REFERENCES admissions(admission_id) ON DELETE CASCADE,
        from_dept_id INTEGER REFERENCES departments(dept_id),
        to_dept_id INTEGER REFERENCES departments(dept_id),
        transfer_time TEXT NOT NULL,
        reason TEXT
    )""",
    """CREATE TABLE audit_log (
        log_id INTEGER PRIMARY KEY AUTOINCREMENT,
        table_name TEXT NOT NULL,
        row_id INTEGER NOT NULL,
        action TEXT NOT NULL,
        old_value TEXT,
        new_value TEXT,
        logged_at TEXT NOT NULL DEFAULT (datetime('now'))
    )""",
    "CREATE INDEX idx_admissions_patient ON admissions(patient_id)",
    "CREATE INDEX idx_admissions_admit_time ON admissions(admit_time)",
    "CREATE INDEX idx_admissions_dept ON admissions(dept_id)",
    "CREATE INDEX idx_diagnoses_admission ON diagnoses(admission_id)",
    "CREATE INDEX idx_diagnoses_icd ON diagnoses(icd_code)",
    "CREATE INDEX idx_lab_results_admission ON lab_results(admission_id)",
    "CREATE INDEX idx_lab_results_test ON lab_results(test_name)",
    "CREATE INDEX idx_prescriptions_admission ON prescriptions(admission_id)",
    """CREATE VIEW v_admission_summary AS
        SELECT a.admission_id, a.patient_id, p.first_name || ' ' || p.last_name AS patient_name,
               d.name AS department, a.admission_type, a.admit_time, a.discharge_time,
               ROUND(julianday(a.discharge_time) - julianday(a.admit_time), 2) AS los_days,
               a.total_charge
        FROM admissions a
        JOIN patients p ON p.patient_id = a.patient_id
        JOIN departments d ON d.dept_id = a.dept_id""",
    """CREATE TRIGGER trg_admissions_discharge_audit
        AFTER UPDATE OF discharge_time ON admissions
        WHEN OLD.discharge_time IS NOT NEW.discharge_time
        BEGIN
            INSERT INTO audit_log (table_name, row_id, action, old_value, new_value)
            VALUES ('admissions', NEW.admission_id, 'discharge_update', OLD.discharge_time, NEW.discharge_time);
        END""",
]

DEPARTMENTS = [
    ("Cardiology", 3, "North Tower", 40),
    ("Neurology", 4, "North Tower", 28),
    ("Orthopedics", 2, "East Wing", 32),
    ("Oncology", 5, "North Tower", 36),
    ("Pediatrics", 1, "West Wing", 30),
    ("General Surgery", 2, "Main Building", 44),
    ("Internal Medicine", 3, "Main Building", 60),
    ("Emergency Medicine", 0, "Main Building", 24),
    ("Nephrology", 4, "East Wing", 18),
    ("Pulmonology", 5, "East Wing", 22),
    ("Obstetrics", 1, "West Wing", 26),
    ("Gastroenterology", 6, "North Tower", 20),
]
SPECIALTY = {
    "Cardiology": "Cardiologist",
    "Neurology": "Neurologist",
    "Orthopedics": "Orthopedic Surgeon",
    "Oncology": "Oncologist",
    "Pediatrics": "Pediatrician",
    "General Surgery": "General Surgeon",
    "Internal Medicine": "Internist",
    "Emergency Medicine": "Emergency Physician",
    "Nephrology": "Nephrologist",
    "Pulmonology": "Pulmonologist",
    "Obstetrics": "Obstetrician",
    "Gastroenterology": "Gastroenterologist",
}
FIRST_M = [
    "James",
    "John",
    "Robert",
    "Michael",
    "William",
    "David",
    "Richard",
    "Joseph",
    "Thomas",
    "Charles",
    "Daniel",
    "Matthew",
    "Anthony",
    "Mark",
    "Steven",
    "Paul",
    "Andrew",
    "Joshua",
    "Kevin",
    "Brian",
    "George",
    "Omar",
    "Luis",
    "Hiroshi",
    "Ahmed",
    "Ivan",
    "Carlos",
    "Wei",
]
FIRST_F = [
    "Mary",
    "Patricia",
    "Jennifer",
    "Linda",
    "Elizabeth",
    "Barbara",
    "Susan",
    "Jessica",
    "Sarah",
    "Karen",
    "Nancy",
    "Lisa",
    "Betty",
    "Margaret",
    "Sandra",
    "Ashley",
    "Emily",
    "Donna",
    "Michelle",
    "Carol",
    "Amanda",
    "Fatima",
    "Sofia",
    "Yuki",
    "Priya",
    "Olga",
    "Mei",
]
LAST = [
    *SURNAMES,
    "Nguyen",
    "Hill",
    "Flores",
    "Green",
    "Adams",
    "Nelson",
    "Baker",
    "Hall",
    "O'Brien",
    "Campbell",
    "Mitchell",
    "Carter",
    "Roberts",
    "Kim",
    "Patel",
    "Chen",
    "Novak",
    "Schmidt",
]
CITIES = [
    "Springfield",
    "Riverton",
    "Fairview",
    "Greenville",
    "Madison",
    "Clinton",
    "Franklin",
    "Georgetown",
    "Salem",
    "Oakdale",
    "Lakewood",
    "Ashland",
]
INSURERS = ["BlueCross", "Aetna", "UnitedHealth", "Cigna", "Medicare", "Medicaid", "Humana"]
BLOOD = ["O+", "O+", "O+", "A+", "A+", "B+", "AB+", "O-", "A-", "B-", "AB-"]
ALLERGENS = ["penicillin", "sulfa", "latex", "peanuts", "aspirin", "iodine", "codeine", "shellfish"]
ADMISSION_TYPES = [
    "Emergency",
    "Emergency",
    "Emergency",
    "Elective",
    "Elective",
    "Urgent",
    "Newborn",
]
DISPOSITIONS = [
    "Home",
    "Home",
    "Home",
    "Home",
    "Home Health",
    "Skilled Nursing",
    "Transfer",
    "Deceased",
    "AMA",
]
# icd_code, description, departments it is typical for
ICD = [
    ("I21.4", "Non-ST elevation myocardial infarction", "Cardiology"),
    ("I50.9", "Heart failure, unspecified", "Cardiology"),
    ("I48.91", "Atrial fibrillation", "Cardiology"),
    ("I10", "Essential hypertension", "Internal Medicine"),
    ("I63.9", "Cerebral infarction, unspecified", "Neurology"),
    ("G40.909", "Epilepsy, unspecified", "Neurology"),
    ("G43.909", "Migraine, unspecified", "Neurology"),
    ("S72.001A", "Fracture of neck of right femur", "Orthopedics"),
    ("M17.11", "Primary osteoarthritis, right knee", "Orthopedics"),
    ("C34.90", "Malignant neoplasm of lung", "Oncology"),
    ("C50.919", "Malignant neoplasm of breast", "Oncology"),
    ("C18.9", "Malignant neoplasm of colon", "Oncology"),
    ("J45.909", "Asthma, uncomplicated", "Pediatrics"),
    ("J21.9", "Acute bronchiolitis", "Pediatrics"),
    ("K35.80", "Acute appendicitis", "General Surgery"),
    ("K80.20", "Calculus of gallbladder", "General Surgery"),
    ("E11.9", "Type 2 diabetes mellitus without complications", "Internal Medicine"),
    ("E11.65", "Type 2 diabetes mellitus with hyperglycemia", "Internal Medicine"),
    ("A41.9", "Sepsis, unspecified organism", "Internal Medicine"),
    ("R07.9", "Chest pain, unspecified", "Emergency Medicine"),
    ("T78.40XA", "Allergy, unspecified", "Emergency Medicine"),
    ("N17.9", "Acute kidney failure, unspecified", "Nephrology"),
    ("N18.4", "Chronic kidney disease, stage 4", "Nephrology"),
    ("J44.1", "COPD with acute exacerbation", "Pulmonology"),
    ("J18.9", "Pneumonia, unspecified organism", "Pulmonology"),
    ("U07.1", "COVID-19", "Pulmonology"),
    ("O80", "Encounter for full-term uncomplicated delivery", "Obstetrics"),
    ("O24.419", "Gestational diabetes mellitus", "Obstetrics"),
    ("K92.2", "Gastrointestinal hemorrhage", "Gastroenterology"),
    ("K50.90", "Crohn's disease, unspecified", "Gastroenterology"),
    ("K70.30", "Alcoholic cirrhosis of liver", "Gastroenterology"),
]
# test, unit, ref_low, ref_high, mean, sd
LABS = [
    ("Hemoglobin", "g/dL", 12.0, 17.5, 13.2, 2.0),
    ("WBC", "10^9/L", 4.0, 11.0, 8.5, 3.5),
    ("Platelets", "10^9/L", 150.0, 400.0, 250.0, 80.0),
    ("Sodium", "mmol/L", 135.0, 145.0, 139.0, 4.0),
    ("Potassium", "mmol/L", 3.5, 5.1, 4.2, 0.6),
    ("Creatinine", "mg/dL", 0.6, 1.3, 1.1, 0.6),
    ("Glucose", "mg/dL", 70.0, 99.0, 118.0, 40.0),
    ("HbA1c", "%", 4.0, 5.6, 6.1, 1.3),
    ("Troponin I", "ng/mL", 0.0, 0.04, 0.05, 0.2),
    ("ALT", "U/L", 7.0, 56.0, 35.0, 25.0),
    ("CRP", "mg/L", 0.0, 10.0, 18.0, 25.0),
]
DRUGS = [
    ("Metformin", [500, 850, 1000], "BID", "oral"),
    ("Lisinopril", [5, 10, 20], "QD", "oral"),
    ("Atorvastatin", [10, 20, 40, 80], "QD", "oral"),
    ("Heparin", [5000], "TID", "subcutaneous"),
    ("Ceftriaxone", [1000, 2000], "QD", "IV"),
    ("Vancomycin", [1000, 1250], "BID", "IV"),
    ("Furosemide", [20, 40, 80], "BID", "IV"),
    ("Ondansetron", [4, 8], "PRN", "IV"),
    ("Morphine", [2, 4], "PRN", "IV"),
    ("Acetaminophen", [500, 650, 1000], "PRN", "oral"),
    ("Insulin glargine", [10, 20, 30], "QD", "subcutaneous"),
    ("Amoxicillin", [250, 500], "TID", "oral"),
    ("Prednisone", [10, 20, 40], "QD", "oral"),
    ("Pantoprazole", [40], "QD", "oral"),
    ("Aspirin", [81, 325], "QD", "oral"),
    ("Warfarin", [2, 5], "QD", "oral"),
]
TRANSFER_REASONS = [
    "Step-down care",
    "Escalation of care",
    "Bed availability",
    "Post-operative recovery",
    "Specialist management",
    None,
]

FMT = "%Y-%m-%d %H:%M:%S"
START = datetime(2019, 1, 1)
END = datetime(2023, 12, 31, 23, 59)


def _ts(dt: datetime) -> str:
    return dt.strftime(FMT)


def build(conn: sqlite3.Connection) -> None:
    rng = random.Random(SEED)
    for stmt in SCHEMA:
        conn.execute(stmt)

    conn.executemany(
        "INSERT INTO departments VALUES (?,?,?,?,?)",
        ((i, n, f, b, c) for i, (n, f, b, c) in enumerate(DEPARTMENTS, 1)),
    )

    physicians = []  # (id, dept_id)
    rows = []
    for pid in range(1, 81):
        dept_id = (pid - 1) % len(DEPARTMENTS) + 1
        female = rng.random() < 0.45
        first = rng.choice(FIRST_F if female else FIRST_M)
        last = rng.choice(LAST)
        hire = datetime(1998, 1, 1) + timedelta(days=rng.randrange(0, 365 * 24))
        email = (
            None
            if rng.random() < 0.08
            else f"{first[0].lower()}.{last.lower().replace(chr(39), '')}{pid}@stmarys-hospital.org"
        )
        status = "retired" if rng.random() < 0.07 else "active"
        rows.append(
            (
                pid,
                first,
                last,
                SPECIALTY[DEPARTMENTS[dept_id - 1][0]],
                dept_id,
                hire.strftime("%Y-%m-%d"),
                email,
                status,
            )
        )
        physicians.append((pid, dept_id))
    conn.executemany("INSERT INTO physicians VALUES (?,?,?,?,?,?,?,?)", rows)
    by_dept: dict[int, list[int]] = {}
    for pid, d in physicians:
        by_dept.setdefault(d, []).append(pid)

    def patients():
        for pid in range(1, N_PATIENTS + 1):
            r = rng.random()
            sex = "F" if r < 0.51 else ("M" if r < 0.985 else None)
            first = rng.choice(FIRST_F if sex == "F" else FIRST_M)
            last = rng.choice(LAST)
            birth = datetime(1930, 1, 1) + timedelta(days=rng.randrange(0, 365 * 88))
            blood = None if rng.random() < 0.15 else rng.choice(BLOOD)
            city = rng.choice(CITIES)
            if rng.random() < 0.04:
                city += " "  # data-entry leftovers
            ins = None if rng.random() < 0.1 else rng.choice(INSURERS)
            contact = (
                None
                if rng.random() < 0.2
                else f"{rng.choice(FIRST_F + FIRST_M)} {last} (555-{rng.randrange(100, 1000):03d}-{rng.randrange(0, 10000):04d})"
            )
            a = rng.random()
            if a < 0.12:
                allergies = None
            elif a < 0.7:
                allergies = "[]"
            else:
                allergies = json.dumps(sorted(rng.sample(ALLERGENS, rng.choice([1, 1, 1, 2, 3]))))
            reg = max(birth, datetime(2005, 1, 1)) + timedelta(
                days=rng.randrange(0, 365 * 3), minutes=rng.randrange(0, 1440)
            )
            yield (
                pid,
                f"MRN{1000000 + pid * 7:07d}",
                first,
                last,
                sex,
                birth.strftime("%Y-%m-%d"),
                blood,
                city,
                ins,
                contact,
                allergies,
                _ts(min(reg, datetime(2018, 12, 31, 9, 30))),
            )

    conn.executemany("INSERT INTO patients VALUES (?,?,?,?,?,?,?,?,?,?,?,?)", patients())

    span_min = int((END - START).total_seconds() // 60)
    admit_times = sorted(
        START + timedelta(minutes=rng.randrange(0, span_min)) for _ in range(N_ADMISSIONS)
    )
    # a minority of frequent flyers
    frequent = [rng.randrange(1, N_PATIENTS + 1) for _ in range(300)]

    adm_rows, diag_rows, lab_rows, rx_rows, tr_rows = [], [], [], [], []
    lab_id = diag_id = rx_id = tr_id = 0
    for aid, admit in enumerate(admit_times, 1):
        patient = rng.choice(frequent) if rng.random() < 0.25 else rng.randrange(1, N_PATIENTS + 1)
        icd_main = rng.choice(ICD)
        dept_id = next(i for i, d in enumerate(DEPARTMENTS, 1) if d[0] == icd_main[2])
        atype = (
            "Newborn" if dept_id == 5 and rng.random() < 0.2 else rng.choice(ADMISSION_TYPES[:-1])
        )
        physician = None if rng.random() < 0.02 else rng.choice(by_dept[dept_id])
        los_hours = max(3.0, rng.lognormvariate(4.0, 0.8))
        discharge = admit + timedelta(minutes=int(los_hours * 60))
        still_in = discharge > END or (rng.random() < 0.015 and admit > datetime(2023, 9, 1))
        if still_in:
            dis_txt = disp = charge = None
        else:
            dis_txt = _ts(discharge)
            disp = rng.choice(DISPOSITIONS)
            charge = round(1200 + los_hours * rng.uniform(90, 260) + rng.uniform(0, 4000), 2)
        room = f"{DEPARTMENTS[dept_id - 1][1]}{rng.randrange(1, 40):02d}{rng.choice('AB')}"
        adm_rows.append(
            (aid, patient, physician, dept_id, atype, _ts(admit), dis_txt, disp, room, charge)
        )

        codes = [icd_main, *rng.sample(ICD, rng.choice([0, 0, 1, 1, 2]))]
        seen = set()
        for k, (code, desc, _) in enumerate(codes):
            if code in seen:
                continue
            seen.add(code)
            diag_id += 1
            when = admit + timedelta(minutes=rng.randrange(10, 600) * (k + 1))
            diag_rows.append((diag_id, aid, code, desc, 1 if k == 0 else 0, _ts(when)))

        n_labs = rng.choice([2, 3, 4, 4, 5, 6, 7])
        horizon = max(
            60,
            int(los_hours * 60) if not still_in else int((END - admit).total_seconds() // 60) or 60,
        )
        for test, unit, lo, hi, mean, sd in rng.sample(LABS, min(n_labs, len(LABS))):
            lab_id += 1
            collected = admit + timedelta(minutes=rng.randrange(15, max(16, horizon)))
            value = round(max(0.0, rng.gauss(mean, sd)), 2 if hi < 1 else 1)
            u, vlo, vhi = unit, lo, hi
            status = "final"
            if test == "Creatinine" and rng.random() < 0.06:
                u, value, vlo, vhi = "umol/L", round(value * 88.4, 1), 53.0, 115.0
            if rng.random() < 0.03:
                value, status = None, rng.choice(["cancelled", "hemolyzed"])
            flag = (
                None if value is None else ("H" if value > vhi else ("L" if value < vlo else None))
            )
            lab_rows.append((lab_id, aid, test, value, u, vlo, vhi, flag, status, _ts(collected)))

        for _ in range(rng.choice([0, 1, 2, 2, 3])):
            drug, doses, freq, route = rng.choice(DRUGS)
            rx_id += 1
            s = admit + timedelta(minutes=rng.randrange(30, 240))
            end = None if still_in or rng.random() < 0.1 else _ts(discharge).split(" ")[0]
            rx_rows.append(
                (
                    rx_id,
                    aid,
                    drug,
                    float(rng.choice(doses)),
                    freq,
                    route,
                    s.strftime("%Y-%m-%d"),
                    end,
                )
            )

        if los_hours > 48 and rng.random() < 0.3:
            tr_id += 1
            to = rng.randrange(1, len(DEPARTMENTS) + 1)
            when = admit + timedelta(minutes=rng.randrange(60, int(los_hours * 30)))
            tr_rows.append(
                (
                    tr_id,
                    aid,
                    dept_id,
                    to if to != dept_id else 7,
                    _ts(when),
                    rng.choice(TRANSFER_REASONS),
                )
            )

    conn.executemany("INSERT INTO admissions VALUES (?,?,?,?,?,?,?,?,?,?)", adm_rows)
    conn.executemany("INSERT INTO diagnoses VALUES (?,?,?,?,?,?)", diag_rows)
    conn.executemany("INSERT INTO lab_results VALUES (?,?,?,?,?,?,?,?,?,?)", lab_rows)
    conn.executemany("INSERT INTO prescriptions VALUES (?,?,?,?,?,?,?,?)", rx_rows)
    conn.executemany('INSERT INTO "Ward Transfers" VALUES (?,?,?,?,?,?)', tr_rows)
    conn.executemany(
        "INSERT INTO audit_log (table_name, row_id, action, old_value, new_value, logged_at) VALUES (?,?,?,?,?,?)",
        (
            ("admissions", r[0], "discharge_update", None, r[6], r[6])
            for r in adm_rows[-40:]
            if r[6]
        ),
    )
